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
  soon as only one claimant is left. Each claimant's refusal names the others, and how to decide.
- An operator decides with the run-config key `partition-bindings`, "NODE:PARTITION,...": node ids
  as the SuperLink knows them (with SuperNode authentication, `flwr supernode register` binds each
  id to the node's key, so another node cannot take it). A bound partition is served by its node
  alone, whoever else claims it (they are refused, naming the binding); a bound node that claims
  another partition serves nothing. Partitions it does not name follow the contest rule above.
- A refusal is never permanent: refused and contesting nodes are asked again at the next
  discovery (once per round), so a node refused under a count that later changed, or the honest
  claimant of a contest whose liar left, is served again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from fedskew.schema import parse_bindings

Report = tuple[int, int]  # (partition-id, num-partitions) as a node reported them
DECIDE = 'an operator decides with the run-config key partition-bindings="NODE:PARTITION"'


def majority_count(reports: Mapping[int, Report]) -> int | None:
    """The partition count that more than half of the reporting nodes give, or None."""
    counts = Counter(num for _, num in reports.values())
    if not counts:
        return None
    num, votes = counts.most_common(1)[0]
    return num if 2 * votes > len(reports) else None


def assign_partitions(
    reports: Mapping[int, Report], expected: int | None, bindings: str = ""
) -> tuple[dict[int, int], dict[int, str]]:
    """(node -> partition of every node that serves one, node -> reason of every other node).

    A node serves its partition when it reported `expected` partitions (None: no count is agreed
    yet, so nobody serves) and, for a partition `bindings` (`partition-bindings`) binds, it is the
    bound node; for another partition, when no other node in `reports` claims the same one."""
    if expected is None:
        return {}, {n: "no partition count is agreed yet: no strict majority of the nodes reports one" for n in reports}
    bound = parse_bindings(bindings)
    holder = {pid: node for node, pid in bound.items()}
    refused = {}
    for node, (pid, num) in reports.items():
        if num != expected:
            refused[node] = f"num-partitions={num}, but the run has {expected} partitions"
        elif node in bound and bound[node] != pid:
            refused[node] = f"it claims partition {pid}, but partition-bindings binds it to partition {bound[node]}"
        elif holder.get(pid, node) != node:
            refused[node] = f"partition {pid} is bound to node {holder[pid]} (partition-bindings)"
    claimants: dict[int, list[int]] = {}  # of the claims left
    for node, (pid, _) in sorted(reports.items()):
        if node not in refused:
            claimants.setdefault(pid, []).append(node)
    served = {}
    for pid, nodes in claimants.items():
        if len(nodes) == 1 or pid in holder:  # a bound partition's claims left are its node's alone
            served[nodes[0]] = pid
            continue
        for node in nodes:
            others = ", ".join(str(n) for n in nodes if n != node)
            refused[node] = (
                f"partition {pid} is also claimed by node {others}: served by none while contested; {DECIDE}"
            )
    return served, refused
