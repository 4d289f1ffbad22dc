"""Every program a test spawns that makes process groups tears them down on the way out.

A rank that leaves gloo's threads to interpreter exit sometimes dies by SIGABRT after its
work is done ("terminate called without an active exception"): a passing test reported as
failed, at random, on a busy machine. The programs are the rank scripts under
tests/integration/scripts and the program texts that test modules hand to `python -c`; each one
that makes torch.distributed's or Megatron's groups runs inside `rank_program()`
(megarl.backends.megatron.parallel), and each weight-update group it makes is closed.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS / "integration" / "scripts"

# Calls that make the default group or Megatron's groups (MegatronWorker makes both).
_MAKES_GROUPS = re.compile(r"\b(init_process_group|init_distributed|initialize_model_parallel|"
                           r"MegatronWorker(\.from_spec)?)\s*\(")
_UPDATE_GROUP = re.compile(r"\bnew_update_group\s*\(")


def problems(source: str) -> list[str]:
    """What a program's text leaves to interpreter exit (empty: nothing)."""
    found = []
    if _MAKES_GROUPS.search(source) and not re.search(r"\bwith\s+rank_program\(\)", source):
        found.append("makes process groups outside `with rank_program():`")
    if _UPDATE_GROUP.search(source) and not re.search(
            r"\bwith\s+new_update_group\(|\.close\(\)", source):
        found.append("makes a weight-update group and never closes it")
    return found


def _program_texts(path: Path):
    """(where, text) of the program texts in one test module: its string constants (and the
    literal parts of f-strings) that look like code."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values
                           if isinstance(v, ast.Constant) and isinstance(v.value, str))
        else:
            continue
        if "\n" in text and re.search(r"^\s*(import|from)\s", text, re.M):
            yield f"{path.relative_to(TESTS)}:{node.lineno}", text


def test_the_check_catches_a_program_that_leaves_its_groups():
    bare = "import torch.distributed as dist\ndist.init_process_group('gloo')\nrun()\n"
    assert problems(bare) == ["makes process groups outside `with rank_program():`"]
    guarded = ("from megarl.backends.megatron.parallel import rank_program\n"
               "with rank_program():\n    dist.init_process_group('gloo')\n")
    assert problems(guarded) == []
    assert problems("g = new_update_group('127.0.0.1', 1, 0, 2, 'g')\ng.broadcast(t)\n") == \
        ["makes a weight-update group and never closes it"]
    assert problems("with new_update_group('127.0.0.1', 1, 0, 2, 'g') as g:\n    pass\n") == []


def test_every_spawned_rank_program_tears_its_groups_down():
    programs = [(str(p.relative_to(TESTS)), p.read_text()) for p in sorted(SCRIPTS.glob("*.py"))]
    for module in sorted(TESTS.rglob("*.py")):
        if SCRIPTS not in module.parents and module != Path(__file__).resolve():
            programs.extend(_program_texts(module))
    bad = {where: why for where, text in programs if (why := problems(text))}
    assert not bad, bad
    # The check looks at what it should: the rank scripts and the inline export program.
    making = [where for where, text in programs if _MAKES_GROUPS.search(text)]
    assert len(making) >= 8 and any("test_dryrun.py" in w for w in making), making
