-- Question (staged as the temp table phase_inst by pipelines.phase_view): every instance of a phase or a step
-- (the temp table phase_spec names them: the rlkernel domain's `phase:<name>` ranges, --phase, --step-range),
-- with its numbers from range_instances (wall span, GPU projection, GPU busy time as the union of the GPU ops
-- launched inside it on its thread, host syncs, device-to-host copies) and the step it lies in: the step instance
-- of the same process whose span holds it (the innermost, should steps nest), the step itself for a step.
-- step_index: the step's int64 payload (rlkernel.step() puts its index there), else its instance number - 1.
WITH
inst AS (
    SELECT ps.name, ps.is_step, i.range_id, i.range, i.style, i.instance, i.tid, i.tid >> 24 AS proc, i.start,
           i."end", i.dur, i.proj_ns, i.gpu_ops, i.kernel_ns, i.gpu_busy_ns, i.host_syncs, i.dtoh_copies,
           r.payload
    FROM phase_spec AS ps
    JOIN range_instances AS i ON i.range = ps.range
    JOIN ranges AS r USING (range_id)
),
steps AS (
    SELECT range_id, proc, start, "end", coalesce(payload, instance - 1) AS step_index
    FROM inst WHERE is_step
),
placed AS (
    SELECT p.range_id, s.range_id AS step_id, s.step_index
    FROM inst AS p
    JOIN steps AS s ON s.proc = p.proc AND s.start <= p.start AND p."end" <= s."end"
                   AND (NOT p.is_step OR s.range_id = p.range_id)
    QUALIFY row_number() OVER (PARTITION BY p.range_id ORDER BY s."end" - s.start, s.range_id) = 1
)
SELECT inst.*, placed.step_id, placed.step_index
FROM inst LEFT JOIN placed USING (range_id)
ORDER BY inst.start, inst.range_id;
