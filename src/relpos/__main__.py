import sys

from relpos.cli import main

sys.exit(main())
