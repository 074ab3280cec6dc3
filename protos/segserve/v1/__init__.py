"""segserve.v1: the wire contracts and, beside them, the one Python type of each.

Generated stubs (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`): edit the .proto files, then
run `python -m protos.generate`. Contract types, torch-free, each with its proto
conversion (`to_pb` / `from_pb`) next to it; every service imports them from here:
- sampling.py: SamplingParams, StoppingCriteria, and validate(), the one owner of every range rule;
- generate.py: the router <-> scheduler Generate request and its stream events;
- step.py: the scheduler <-> worker Step request;
- step_result.py: the worker's answer to it, the Step result;
- tree.py: CandidateTree, the one encoding of a draft tree;
- info.py: WorkerInfo and Health;
- stats.py: the drafter's GetStats answer and the scheduler's view of each drafter replica.
"""
