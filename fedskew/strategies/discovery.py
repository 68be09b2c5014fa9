"""Which node serves which partition: the rules of node discovery, as pure functions.

Every node answers a `query.info` message with the partition it serves and the number of partitions
it was configured for. None of that is trusted:

- The number of partitions comes from what the server knows: the run config's `num-partitions`
  (`fedskew run` sets it from `-n`; a deployment sets it in the run config). Only when it is 0 (not
  given: a plain `flwr run`) is the count taken from the nodes' reports, and then only a count that a
  strict majority of the connected, reporting nodes agree on (`majority_count`): never the first
  report that arrives. A node that reports another count serves nothing.
- A partition claimed by two or more connected nodes is contested: none of its claimants serves it
  while the contest lasts (the server cannot tell the honest node from the one that lies, and giving
  the partition to whichever answered first would let a fast liar take it). It is served again as
  soon as only one claimant is left.
- A refusal is never permanent: refused and contesting nodes are asked again at the next
  discovery (once per round), so a node refused under a count that later changed, or the honest
  claimant of a contest whose liar left, is served again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

Report = tuple[int, int]  # (partition-id, num-partitions) as a node reported them


def majority_count(reports: Mapping[int, Report]) -> int | None:
    """The partition count that more than half of the reporting nodes give, or None."""
    counts = Counter(num for _, num in reports.values())
    if not counts:
        return None
    num, votes = counts.most_common(1)[0]
    return num if 2 * votes > len(reports) else None


def assign_partitions(reports: Mapping[int, Report], expected: int | None) -> tuple[dict[int, int], dict[int, str]]:
    """(node -> partition of every node that serves one, node -> reason of every other node).

    A node serves its partition when it reported `expected` partitions (None: no count is agreed
    yet, so nobody serves) and no other node in `reports` claims the same partition."""
    if expected is None:
        return {}, {n: "no partition count is agreed yet: no strict majority of the nodes reports one" for n in reports}
    matching = {n: pid for n, (pid, num) in reports.items() if num == expected}
    claimants: dict[int, list[int]] = {}
    for node, pid in sorted(matching.items()):
        claimants.setdefault(pid, []).append(node)
    served, refused = {}, {}
    for node, (pid, num) in reports.items():
        if num != expected:
            refused[node] = f"num-partitions={num}, but the run has {expected} partitions"
        elif len(claimants[pid]) > 1:
            others = ", ".join(str(n) for n in claimants[pid] if n != node)
            refused[node] = f"partition {pid} is also claimed by node {others}: served by none while contested"
        else:
            served[node] = pid
    return served, refused
