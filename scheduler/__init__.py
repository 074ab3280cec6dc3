"""The scheduler: owns the request queue and forms a batch every step (continuous batching).

In: GenerateRequest streams from the router (gRPC, token ids only). Out: one
StepRequest per step to the worker, and GenerateResponse events (token chunks,
then `complete` or `error`) back to the router.

Layers, outermost first:
- main.py / actor.py: a local Ray instance hosting `SchedulerActor`, which runs
  the gRPC server and the engine on one asyncio loop.
- servicer.py + convert.py: the Scheduler gRPC service; protobuf <-> dataclasses
  and request validation happen here only.
- engine.py: the async step loop (schedule -> draft -> worker step ->
  postprocess) and per-request event streams.
- worker_client.py, drafter_client.py: gRPC clients to the worker and the
  drafter replicas (protobuf converted here).
- speculator.py: one batched Draft call per step; usable trees go to the
  scheduler, failures only make the step plain.
- scheduler.py, block_manager.py, sequence.py, outputs.py, stopping.py,
  draft_trees.py, spec_policy.py: pure logic, no I/O (spec_policy chooses the
  node budget from measured step times and acceptance).
"""
