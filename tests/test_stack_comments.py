"""The stack files state no arithmetic in comments (issue 41 item 8): a hand-written "128 + 8 = 136 <=
144" went stale while `supernode plan` printed 64 + 8 = 72 <= 152. The plan is the one place figures
are computed; comments say what is checked and point at it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a sum or product with its result ("16 + 1 = 17"),
# ("4 x tp 4 = 16", a few words allowed between), or a number compared with a number ("72 <= 152")
ARITHMETIC = re.compile(
    r"(?<![\w.])\d+(?:\s*(?:[-+×*/]|\bx\b)\s*(?:[A-Za-z]+\s+){0,3}\d+)+\s*=\s*\d+|\d+\s*(?:<=|>=|≤|≥)\s*\d+"
)


def arithmetic_in_comments(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        comment = line.partition("#")[2]
        if ARITHMETIC.search(comment):
            found.append(f"line {number}: {line.strip()}")
    return found


def test_no_stack_file_states_arithmetic_in_a_comment():
    stacks = sorted(ROOT.glob("Pulumi.*.yaml")) + sorted((ROOT / "supernode/cli/project").glob("Pulumi.*.yaml"))
    assert stacks
    stale = {p.name: found for p in stacks if (found := arithmetic_in_comments(p.read_text()))}
    assert not stale, f"arithmetic in stack-file comments (the plan computes it; say what is checked): {stale}"


def test_the_check_sees_the_arithmetic_that_went_stale():
    assert arithmetic_in_comments("    # (training min 128 + serving min 8 = 136 <= 144, the policy)")
    assert arithmetic_in_comments("# replicasMax 4 x tp 4 = 16 GPUs")
    assert not arithmetic_in_comments("# one Trn2 UltraServer: 64 Trainium2 chips\nname: gpu-p5-a  # 8 nodes")
    assert not arithmetic_in_comments("# (u-trn2x64 = 4 x trn2u.48xlarge)")  # a name, not a sum
