"""Every code example of the documentation runs: README.md, docs/*.md and public docstrings.

Markdown: each ```python block of README.md and docs/*.md runs as it would pasted alone
into a fresh ``python``: in a process of its own, without the 8 CPU devices that
tests/conftest.py sets up (a block that needs several devices sets ``XLA_FLAGS`` itself,
before it imports jax). The processes are forked from one Python that has imported jax
(tests/fresh_util.py), one block after the other. A page may have one setup block, marked
by an HTML comment on the line right above its opening fence:

    <!-- docs-test: setup (what the page's other blocks take from it) -->

Its other blocks then run pasted after the setup block (docs/moe.md says so at its top).
A block that cannot run here (it needs `python -m jaxcomm.launch`, several processes, or a
GPU) is marked so, which renders as nothing:

    <!-- docs-test: skip (why it cannot run here, and what runs it instead) -->

Blocks in other languages (```, ```bash, ...) are shown, never run.

Docstrings: the ``>>>`` examples of the public API run as doctests, in a namespace with
``jax``, ``jnp``, ``np``, ``P``, ``NamedSharding`` and ``jaxcomm`` already imported
(the examples import them too, so that they run verbatim from ``help()``). Every public
function and class has such an example; a line that cannot run in one process carries
``# doctest: +SKIP``.

Examples must leave the process as they found it: one that switches ``jax.lax`` to
jaxcomm (``use_for_lax``) must undo it, which the test checks.
"""

from __future__ import annotations

import doctest
import inspect
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src.dropin import collectives as dropin
from fresh_util import Command, run_fresh

ROOT = Path(__file__).resolve().parent.parent
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\b\s*(?:\((?P<why>.*)\))?\s*-->")
SETUP_MARK = re.compile(r"<!--\s*docs-test:\s*setup\b[^>]*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the reason, when marked to skip
    setup: bool = False  # the page's setup block: its other blocks run after it

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[str]:
    return ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def python_blocks(path: str) -> list[Block]:
    """The ```python blocks of one markdown file, with their skip marks."""
    lines = (ROOT / path).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, lang = i, len(m.group("indent")), m.group("lang")
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^ {{{indent}}}```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code block that is never closed")
        i += 1
        if lang != "python":
            continue
        above = lines[start - 1] if start > 0 else ""
        mark = SKIP_MARK.search(above)
        skip = (mark.group("why") or "marked docs-test: skip") if mark else None
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", skip,
                            bool(SETUP_MARK.search(above))))
    if sum(b.setup for b in blocks) > 1:
        raise ValueError(f"{path}: more than one block marked docs-test: setup")
    return blocks


ALL_BLOCKS = [b for f in markdown_files() for b in python_blocks(f)]


# jax.lax's own collectives, taken before any example runs.
_LAX = {name: getattr(jax.lax, name) for name in dropin.COLLECTIVES}


@pytest.fixture(autouse=True)
def _lax_left_alone():
    yield
    switched = sorted(n for n, fn in _LAX.items() if getattr(jax.lax, n) is not fn)
    for name in switched:  # put them back for the tests that run after this one, then fail
        setattr(jax.lax, name, _LAX[name])
    assert not switched, f"the example left jax.lax.{switched} switched (use_for_lax without undo)"


# Run after every block, in its process: an example must not leave jax.lax switched.
_LAX_LEFT_ALONE = """
import jax as _jax
from jaxcomm._src.dropin import collectives as _dropin
_switched = [n for n in _dropin.COLLECTIVES if getattr(_jax.lax, n).__module__.startswith("jaxcomm")]
assert not _switched, f"the example left jax.lax.{_switched} switched (use_for_lax without undo)"
"""


def pasted_program(block: Block) -> str:
    """What a user pastes: the block alone, or after its page's setup block."""
    setup = [b for b in ALL_BLOCKS if b.path == block.path and b.setup and b is not block]
    return "".join(b.code + "\n" for b in setup) + block.code + _LAX_LEFT_ALONE


#: The session's XLA_FLAGS (8 CPU devices) removed: a pasted block starts a plain Python.
_PASTED_ENV: dict[str, str | None] = {"XLA_FLAGS": None}


@pytest.fixture(scope="module")
def fresh_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every block that runs, each in a fresh process, by name (``README.md:70``)."""
    return run_fresh({b.name: Command(code=pasted_program(b), env=_PASTED_ENV)
                      for b in ALL_BLOCKS if not b.skip}, timeout_s=900)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.name for b in ALL_BLOCKS])
def test_markdown_example(block: Block, fresh_runs):
    if block.skip:
        pytest.skip(block.skip)
    done = fresh_runs[block.name]
    after = " after its page's setup block" if not block.setup and any(
        b.setup for b in ALL_BLOCKS if b.path == block.path) else ""
    assert done.returncode == 0, (f"{block.name}, pasted alone{after} into a fresh python, "
                                  f"exited {done.returncode}:\n{done.stdout}{done.stderr[-4000:]}")


def test_skip_marks_name_a_block():
    """A skip (or setup) mark that is not right above a ```python fence would mark nothing
    silently."""
    for path in markdown_files():
        lines = (ROOT / path).read_text().splitlines()
        for i, line in enumerate(lines):
            if SKIP_MARK.search(line) or SETUP_MARK.search(line):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                assert nxt.strip() == "```python", f"{path}:{i + 1}: mark not above a python block"


def test_every_file_has_been_read():
    # The parser must see the README's examples (the ones a new user copies first), and
    # docs/moe.md's, which build on its setup block.
    assert sum(b.path == "README.md" and not b.skip for b in ALL_BLOCKS) >= 2
    moe = [b for b in ALL_BLOCKS if b.path == "docs/moe.md"]
    assert len(moe) >= 7 and moe[0].setup and not any(b.skip for b in moe), moe


# Pages linked before they are written (none now): a link to one is not reported broken.
PENDING_PAGES: set[str] = set()
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_links_resolve():
    """Every relative link of README.md and docs/*.md names a file (and heading) that exists."""
    broken = []
    for path in ["README.md"] + [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")]:
        text = re.sub(r"```.*?```", "", (ROOT / path).read_text(), flags=re.S)
        for m in LINK.finditer(text):
            target = m.group("target")
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            resolved = (ROOT / path).parent / file_part if file_part else ROOT / path
            rel = os.path.relpath(resolved, ROOT)
            if not resolved.exists():
                if rel not in PENDING_PAGES:
                    broken.append(f"{path}: {target}")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{path}: {target} (no such heading)")
    assert not broken, broken


# --- docstrings -------------------------------------------------------------------------

def public_api() -> dict[str, object]:
    """Every public function and class of jaxcomm and its public modules, by dotted name."""
    out: dict[str, object] = {}
    for mod_name, mod in (("jaxcomm", jaxcomm), ("jaxcomm.moe", jaxcomm.moe),
                          ("jaxcomm.ft", jaxcomm.ft), ("jaxcomm.trace", jaxcomm.trace)):
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                out[f"{mod_name}.{name}"] = obj
    return out


def lax_api() -> dict[str, object]:
    """jaxcomm.lax's own functions (its other names are jax.lax's, with jax's docstrings)."""
    return {f"jaxcomm.lax.{n}": getattr(jaxcomm.lax, n) for n in jaxcomm.lax.__all__
            if getattr(getattr(jaxcomm.lax, n), "__module__", "").startswith("jaxcomm")}


# Public names whose docstring needs no example: data holders, and functions whose one
# call is their whole story (another example, the module docstring or docs/ shows them).
NO_EXAMPLE = {
    "jaxcomm.LaxSwitch",  # made by use_for_lax, whose example shows it
    "jaxcomm.moe.Handle",  # returned by dispatch, whose example shows it
    "jaxcomm.moe.combine", "jaxcomm.moe.combine_padded",  # in dispatch's examples
    "jaxcomm.moe.combine_low_latency",  # in dispatch_low_latency's example
    "jaxcomm.moe.PendingDispatch", "jaxcomm.moe.PendingCombine",  # returned by the send halves
    "jaxcomm.moe.dispatch_recv", "jaxcomm.moe.combine_send", "jaxcomm.moe.combine_recv",  # in dispatch_send's
    "jaxcomm.reset_stats",  # stats(reset=True)
    "jaxcomm.CommMemory",  # returned by memory(), whose example shows it
    "jaxcomm.ft.excluded",  # a list of process indices
    "jaxcomm.trace.analyze",  # in dump's example
    "jaxcomm.trace.dump_path", "jaxcomm.trace.enabled", "jaxcomm.trace.set_enabled",
}


def doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=False)
    tests = []
    objs = dict(public_api())
    objs.update(lax_api())
    for name, obj in sorted(objs.items()):
        for t in finder.find(obj, name, globs={}):
            if t.examples:
                tests.append(t)
    return tests


DOCTESTS = doctests()


def test_public_api_has_examples():
    have = {t.name for t in DOCTESTS}
    missing = sorted(set(public_api()) - have - NO_EXAMPLE)
    assert not missing, f"public functions without a >>> example in their docstring: {missing}"


def test_no_example_left_unrun():
    """An ``Example::`` block without ``>>>`` would be shown by help() and never run."""
    objs = dict(public_api())
    objs.update(lax_api())
    stale = []
    for name, obj in objs.items():
        doc = inspect.getdoc(obj) or ""
        for m in re.finditer(r"Example[^\n]*::\n", doc):
            if ">>>" not in doc[m.end():m.end() + 400]:
                stale.append(name)
    assert not stale, f"examples that no test runs (write them as >>> doctests): {stale}"


#: Doctests whose output depends on what the whole process did before (the flight
#: recorder's verdict over every call it recorded): they run in a fresh process, as a
#: user's would.
FRESH_PROCESS = {"jaxcomm.trace.dump"}

_FRESH = """
import doctest, importlib, sys
# 8 CPU devices: the session's XLA_FLAGS and JAX_PLATFORMS (tests/conftest.py).
module, name = sys.argv[1].rsplit(".", 1)
obj = getattr(importlib.import_module(module), name)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
for test in doctest.DocTestFinder(recurse=False).find(obj, sys.argv[1]):
    runner.run(test)
sys.exit(1 if runner.failures or not runner.tries else 0)
"""


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test: doctest.DocTest):
    if test.name in FRESH_PROCESS:
        # The session's 8 devices, as the in-process doctests have them.
        done = run_fresh({test.name: Command(code=_FRESH, args=[test.name])})[test.name]
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return
    test.globs = {"jax": jax, "jnp": jnp, "np": np, "P": P, "NamedSharding": NamedSharding,
                  "jaxcomm": jaxcomm}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=True)
    assert runner.failures == 0, "".join(out)
