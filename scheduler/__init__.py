"""The scheduler: owns the request queue and forms a batch every step (continuous batching).

In: GenerateRequest streams from the router (gRPC, token ids only). Out: one
StepRequest per step to the worker, and GenerateResponse events (token chunks,
then `complete` or `error`) back to the router. Every type crossing a boundary
is a contract type from protos/segserve/v1 (GenerateRequest, TokenChunk,
GenerateComplete, GenerateError, StepRequest, StepResult, CandidateTree,
WorkerInfo, Health), converted with its own to_pb/from_pb.

Layers, outermost first:
- main.py / actor.py: a local Ray instance hosting `SchedulerActor`, which runs
  the gRPC server and the engine on one asyncio loop.
- servicer.py + convert.py: the Scheduler gRPC service; requests are validated
  here (generate.validate_request), stats converted.
- engine.py: the async step loop (schedule -> draft -> worker step ->
  postprocess -> deliver; with async scheduling a pipelined variant, chosen once);
  worker_link.py: connecting to the worker, the idle health check, the record of a
  lost worker; request_events.py: per-request event queues.
- worker_client.py, drafter_client.py: gRPC clients to the worker and the
  drafter replicas (protobuf converted here).
- traces.py: a traced request's admission, queue and step spans, and the step's trace
  context sent on to the worker and drafters (common/tracing.py; nothing when off).
- speculator.py: chooses, for the scheduler, whom the drafter is asked about, and
  makes one batched Draft call per step; failures only make the step plain. It owns
  the drafter-side state (sync points, segments, ended ids to release, acceptance stats).
- scheduler.py, step_plan.py, step_requests.py, decode_steps.py, drafting.py, admission.py,
  faults.py, block_manager.py, sequence.py, outputs.py, stopping.py, spec_policy.py,
  spec_gate.py: pure logic, no I/O. scheduler.py makes every decision about what runs
  next and returns it as a StepPlan (step_plan.py): the sequences, whom to draft for,
  the trees that fit (drafting.py), how many decode steps (decode_steps.py), whether the
  next step goes ahead of the one in flight. It also handles failed steps: preempt, retry
  at a smaller batch, end the culprit with FINISH_REASON_ERROR, as faults.py decides;
  step_requests.py builds the StepRequests it sends and records what is at the worker;
  admission.py refuses what its queue cannot take; spec_policy chooses the node budget
  from measured step times and acceptance; spec_gate lets each segment kind draft only
  where that measured faster end to end.
"""
