"""What a SuperNode's fresh `flwr-clientapp` process does for one train message, timed step by step
(run by `deploy_breakdown.py` in a new interpreter; prints one JSON line of seconds).

    python benchmarks/_one_message.py METHOD PARTITION-ID NUM-PARTITIONS
"""

import time

T0, WALL0 = time.perf_counter(), time.time()  # the interpreter is up; everything below is timed from here

import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fedskew


def main() -> None:
    method, pid, num = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    marks = {"start": T0}
    import torch

    marks["import torch"] = time.perf_counter()
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp  # noqa: F401  (what flwr-clientapp loads first)

    marks["import flwr"] = time.perf_counter()
    from fedskew.client_app.app import app
    from fedskew.registry import get_method

    get_method(method).trainer_class()
    marks["import ClientApp"] = time.perf_counter()
    from fedskew.config import validate
    from fedskew.data.node import load_node_data
    from fedskew.run.launcher import app_defaults

    run_config = {**app_defaults(Path(__file__).resolve().parent.parent), "method": method}
    node_config = {"partition-id": pid, "num-partitions": num}
    load_node_data(validate(dict(run_config)), node_config)
    marks["data load"] = time.perf_counter()
    # the message as it would arrive from the SuperLink (its making is not timed)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    strategy = get_method(method).strategy_class()(validate(dict(run_config)))
    content = RecordDict({"arrays": strategy.initial_arrays(), "config": ConfigRecord({"server-round": 1})})
    msg = Message(content, dst_node_id=1, message_type="train")
    ctx = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config)
    torch.set_num_threads(1)
    making = time.perf_counter() - marks["data load"]
    t = time.perf_counter()
    app(msg, ctx)
    marks["train (ClientApp call)"] = time.perf_counter()
    steps = list(marks)
    out = {b: marks[b] - marks[a] for a, b in itertools.pairwise(steps)}
    out["train (ClientApp call)"] = marks["train (ClientApp call)"] - t
    out["making the message"] = making
    out["wall at start"], out["wall at end"] = WALL0, time.time()  # epoch seconds, to split start / exit
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
