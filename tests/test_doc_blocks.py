"""Every fenced code block of README.md and docs/*.md runs as printed.

Each page's blocks run in order in one temporary directory (the working directory of every
block): Python blocks through ``exec`` in one namespace per page, bash blocks through
``bash -e`` with this environment's ``relpos``, ``python`` and ``torchrun`` first on PATH,
``RELPOS_CACHE_DIR`` set to the suite's kernel cache (``build/relpos-cache``: no block
recompiles the kernels), ``OMP_NUM_THREADS=1``, ``MPLBACKEND=Agg``, ``DOCS_TEST_ROOT`` set to
the repository root, and a time limit. A failing block is named by its page, its number on
the page (1 = the page's first fenced block), its line and its first line.

Markers: HTML comments on the lines right above a block's opening fence, one directive each,
several allowed (stacked, no blank line between them and the fence):

``<!-- docs-test: network [DETAILS] -->``
    The block needs the network (``pip install``, a model download): not run, reported as
    skipped with that reason, and syntax-checked (``compile()`` for Python, ``bash -n`` for
    bash).
``<!-- docs-test: skip REASON -->``
    Not run for REASON (said in the skip), syntax-checked as above. For blocks that must not
    run here: the setup commands CI itself runs, a block that changes the test process for
    good, a block that needs a process group.
``<!-- docs-test: replace "OLD" "NEW" -->``
    The block runs with every OLD replaced by NEW (markers apply in order): commands that run
    for minutes as printed run at tiny sizes. OLD must occur in the block (after the
    replacements above it), so the marker cannot go stale. NEW may use ``$DOCS_TEST_ROOT``.
``<!-- docs-test: output -->``
    The block (no language) is exactly what the page's previous block prints on stdout;
    checked character for character.
``<!-- docs-test: data REASON -->``
    The block is data, not commands: ``yaml`` must parse (``yaml.safe_load``) to a mapping;
    ``dockerfile`` lines must be Dockerfile instructions whose ``RUN`` commands pass
    ``bash -n``; a block without a language must name in REASON the test that checks it
    (``tests/FILE.py::test_name``), which must exist.

A block is ``python`` or ``bash``, or carries ``output`` or ``data``; anything else, an
unknown directive, or a marker that is not right above a block fails
:func:`test_markers_are_known_and_sit_on_blocks`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
#: Time limit of one bash block, in seconds (the slowest, the README's training block, takes
#: under a minute on 2 busy cores; a kernel source change makes the deployment page's kernels
#: block compile the suite's baseline variant once, relpos._timings.VARIANT_SECONDS).
BLOCK_TIMEOUT_S = 300

MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
DIRECTIVES = ("network", "skip", "replace", "output", "data")
DOCKERFILE_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


@dataclass
class Block:
    page: str
    number: int  # 1-based, among the page's fenced blocks
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        first = next((s for s in self.text.splitlines() if s.strip()), "")
        return f"{self.page} block {self.number} (line {self.line}: {first.strip()!r})"

    def directive(self, name: str) -> str | None:
        """The argument of the block's ``name`` directive ('' if bare), None without one."""
        return next((arg for d, arg in self.directives if d == name), None)

    @property
    def not_run_reason(self) -> str | None:
        network, skip = self.directive("network"), self.directive("skip")
        if network is not None:
            return "needs the network" + (f": {network}" if network else "")
        return skip

    @property
    def runs(self) -> bool:
        return (self.lang in ("python", "bash") and self.not_run_reason is None
                and self.directive("data") is None)


def parse(page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``page`` with their markers, and the problems of its markers."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: list[tuple[int, str]] = []  # markers (line, body) waiting for their fence
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            pending.append((i + 1, marker.group("body")))
        elif "docs-test" in line or "README test" in line:
            problems.append(f"{page}:{i + 1}: not a docs-test marker: {line.strip()!r}")
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")),
                       None)
            if end is None:
                problems.append(f"{page}:{i + 1}: a code block that is never closed")
                break
            block = Block(page, len(blocks) + 1, i + 1, fence.group("lang"),
                          "".join(s + "\n" for s in lines[i + 1:end]))
            for at, body in pending:
                name, _, arg = body.partition(" ")
                if name not in DIRECTIVES:
                    problems.append(f"{page}:{at}: unknown docs-test directive {name!r}; "
                                    f"allowed: {', '.join(DIRECTIVES)}")
                elif name in ("skip", "data") and not arg.strip():
                    problems.append(f"{page}:{at}: {name!r} needs a reason")
                elif name == "output" and arg.strip():
                    problems.append(f"{page}:{at}: 'output' takes no argument")
                elif name == "replace" and len(_replace_args(arg)) != 2:
                    problems.append(f"{page}:{at}: replace takes two quoted strings: {arg!r}")
                block.directives.append((name, arg.strip()))
            pending = []
            blocks.append(block)
            i = end
        elif pending and line.strip():
            problems.append(f"{page}:{pending[0][0]}: a docs-test marker not right above a "
                            "code block")
            pending = []
        elif pending:
            problems.append(f"{page}:{pending[0][0]}: a blank line between a docs-test marker "
                            "and its code block")
            pending = []
        i += 1
    if pending:
        problems.append(f"{page}:{pending[0][0]}: a docs-test marker after the last block")
    for block in blocks:
        kinds = {"python", "bash"}
        if block.lang not in kinds and not ({"output", "data"} & {d for d, _ in block.directives}):
            problems.append(f"{block.name}: a {block.lang or 'plain'} block is neither python nor "
                            "bash: mark it 'output' or 'data REASON'")
        if block.directive("output") is not None and block.lang:
            problems.append(f"{block.name}: an 'output' block has no language")
    return blocks, problems


def _replace_args(arg: str) -> list[str]:
    try:
        return shlex.split(arg)
    except ValueError:
        return []


def _all_blocks() -> list[Block]:
    return [block for page in PAGES for block in parse(page)[0]]


def _source(block: Block) -> str:
    """The block's text with its ``replace`` markers applied."""
    text = block.text
    for name, arg in block.directives:
        if name != "replace":
            continue
        old, new = _replace_args(arg)
        assert old in text, (f"{block.name}: its marker replaces {old!r}, which the block does "
                             "not contain (any more): update the marker")
        text = text.replace(old, new)
    return text


def _environment(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["RELPOS_CACHE_DIR"] = str(ROOT / "build" / "relpos-cache")
    env["OMP_NUM_THREADS"] = "1"
    env["MPLBACKEND"] = "Agg"
    env["MPLCONFIGDIR"] = str(tmp / "matplotlib")
    env["DOCS_TEST_ROOT"] = str(ROOT)
    env.pop("RELPOS_KERNELS_DIR", None)
    return env


def _run_bash(block: Block, source: str, cwd: Path, env: dict[str, str], scripts: Path) -> str:
    script = scripts / f"block{block.number}.sh"
    script.write_text(source)
    try:
        proc = subprocess.run(["bash", "-e", str(script)], cwd=cwd, env=env, text=True,
                              capture_output=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S} s; output:\n{err.stdout}\n"
                    f"{err.stderr}")
    if proc.returncode:
        pytest.fail(f"{block.name} failed with exit status {proc.returncode}:\n"
                    f"--- stdout (end) ---\n{proc.stdout[-3000:]}\n"
                    f"--- stderr (end) ---\n{proc.stderr[-3000:]}")
    return proc.stdout


def _run_python(block: Block, source: str, namespace: dict[str, object]) -> str:
    code = compile(source, f"{block.page} block {block.number}", "exec")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)
    except Exception as err:
        pytest.fail(f"{block.name} raised {type(err).__name__}: {err}")
    return printed.getvalue()


def _pages_that_run() -> list[str]:
    return [page for page in PAGES if any(b.runs for b in parse(page)[0])]


def test_markers_are_known_and_sit_on_blocks():
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)
    assert len(_pages_that_run()) >= 4


def test_a_broken_marker_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: replace \"--steps 300\" \"--steps 3\" -->\n```bash\nrelpos train\n```\n"
        "<!-- docs-test: sikp typo -->\n```python\nx = 1\n```\n"
        "<!-- docs-test: output -->\n\n```\nx\n```\n"
        "```text\nnot marked\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    blocks, problems = parse("page.md")
    assert len(blocks) == 4 and len(problems) == 4, problems
    assert "unknown docs-test directive 'sikp'" in problems[0]
    assert "a blank line between" in problems[1]
    assert "block 3" in problems[2] and "neither python nor bash" in problems[2]
    assert "block 4" in problems[3] and "neither python nor bash" in problems[3]
    with pytest.raises(AssertionError, match="update the marker"):
        _source(blocks[0])


@pytest.mark.parametrize("page", _pages_that_run())
def test_page_blocks_run_as_printed(page, tmp_path, monkeypatch):
    blocks, problems = parse(page)
    assert not problems, "\n".join(problems)
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir()
    scripts.mkdir()
    env = _environment(tmp_path)
    monkeypatch.chdir(work)
    for name in ("OMP_NUM_THREADS", "MPLBACKEND", "MPLCONFIGDIR", "DOCS_TEST_ROOT"):
        monkeypatch.setenv(name, env[name])
    namespace: dict[str, object] = {"__name__": "__docs__"}
    printed: str | None = None  # stdout of the previous block that ran
    for block in blocks:
        if block.directive("output") is not None:
            assert printed is not None, f"{block.name}: no block before it ran to print it"
            assert printed == block.text, (
                f"{block.name} is not what the block before it prints:\n--- printed ---\n"
                f"{printed}--- the page ---\n{block.text}")
            printed = None
        elif not block.runs:
            printed = None
        elif block.lang == "bash":
            printed = _run_bash(block, _source(block), work, env, scripts)
        else:
            printed = _run_python(block, _source(block), namespace)


def _not_run() -> list[Block]:
    return [b for b in _all_blocks() if b.not_run_reason is not None]


@pytest.mark.parametrize("block", _not_run(), ids=lambda b: f"{b.page}:{b.number}")
def test_blocks_not_run_are_syntax_checked(block):
    source = _source(block)
    if block.lang == "python":
        compile(source, block.name, "exec")
    elif block.lang == "bash":
        proc = subprocess.run(["bash", "-n"], input=source, text=True, capture_output=True,
                              timeout=30)
        assert proc.returncode == 0, f"{block.name}: {proc.stderr}"
    else:
        pytest.fail(f"{block.name}: a {block.lang or 'plain'} block cannot be syntax-checked")
    pytest.skip(f"{block.name}: {block.not_run_reason}")


def _data() -> list[Block]:
    return [b for b in _all_blocks() if b.directive("data") is not None]


@pytest.mark.parametrize("block", _data(), ids=lambda b: f"{b.page}:{b.number}")
def test_data_blocks_are_checked(block):
    reason = block.directive("data") or ""
    if block.lang == "yaml":
        import yaml

        assert isinstance(yaml.safe_load(block.text), dict), block.name
    elif block.lang == "dockerfile":
        for line in block.text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            instruction, _, rest = line.strip().partition(" ")
            assert instruction in DOCKERFILE_INSTRUCTIONS, f"{block.name}: {line!r}"
            if instruction == "RUN":
                proc = subprocess.run(["bash", "-n"], input=rest, text=True,
                                      capture_output=True, timeout=30)
                assert proc.returncode == 0, f"{block.name}: {line!r}: {proc.stderr}"
    elif not block.lang:
        found = re.search(r"(tests/[\w/]+\.py)::(\w+)", reason)
        assert found, f"{block.name}: a plain data block names the test that checks it"
        path, test = found.groups()
        assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), flags=re.M), (
            f"{block.name}: {path} has no {test}")
    else:
        pytest.fail(f"{block.name}: no check for {block.lang} data")


def test_architecture_diagram_names_real_folders_and_modules():
    (diagram,) = [b for b in parse("docs/architecture.md")[0] if not b.lang]
    package = ROOT / "src" / "relpos"
    folders = re.findall(r"\b(\w+)/", diagram.text)
    modules = re.findall(r"\b(\w+\.py)\b", diagram.text)
    assert len(folders) >= 9 and len(modules) >= 8, diagram.text
    missing = [f + "/" for f in folders if not (package / f).is_dir()]
    missing += [m for m in modules if not (package / m).is_file()]
    assert not missing, f"docs/architecture.md names what src/relpos lacks: {missing}"
    on_disk = {p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert on_disk <= set(folders), f"folders the diagram leaves out: {on_disk - set(folders)}"
