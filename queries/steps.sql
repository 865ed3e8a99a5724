-- Question: where does each training step go? One row per step instance (phase_inst, is_step): its wall span, the
-- GPU busy time of the ops launched inside it on its thread (an interval union: each nanosecond once), busy %
-- of the wall span, the GPU idle rest of the span, host syncs (NVIDIA's four rules) and device-to-host copies.
-- Each phase's share of the step is phase_shares.sql's.
SELECT
    step_index AS step,
    range,
    instance,
    start AS start_ns,
    dur AS wall_ns,
    gpu_busy_ns,
    round(100.0 * gpu_busy_ns / nullif(dur, 0), 2) AS busy_pct,
    greatest(dur - gpu_busy_ns, 0) AS gpu_idle_ns,
    host_syncs,
    dtoh_copies,
    kernel_ns
FROM phase_inst
WHERE is_step
ORDER BY start, range_id;
