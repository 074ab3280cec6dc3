"""The scheduler: owns the request queue and forms a batch every step (continuous batching).

In: GenerateRequest streams from the router (gRPC, token ids only). Out: one
StepRequest per step to the worker, and GenerateResponse events (token chunks,
then `complete` or `error`) back to the router.

Layers, outermost first:
- main.py / actor.py: a local Ray instance hosting `SchedulerActor`, which runs
  the gRPC server and the engine on one asyncio loop.
- servicer.py + convert.py: the Scheduler gRPC service; protobuf <-> dataclasses
  and request validation happen here only.
- engine.py: the async step loop (schedule -> worker step -> postprocess) and
  per-request event streams.
- worker_client.py: the gRPC client to the worker (protobuf converted here).
- scheduler.py, block_manager.py, sequence.py, outputs.py: pure logic, no I/O.
"""
