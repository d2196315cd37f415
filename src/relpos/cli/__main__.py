import sys

from relpos.cli import main

if __name__ == "__main__":
    sys.exit(main())
