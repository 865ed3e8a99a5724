-- Question (staged as the temp table phase_ops by pipelines.phase_view): every GPU operation launched inside a
-- phase or step instance on its thread (range_ops: the projection's attribution rule), one row per (instance,
-- op), integers only: phase_gaps.sql, phase_kernels.sql and phase_logprobs.sql read it, and the kernels' names
-- are looked up after grouping (by gpu_ops' string ids). Staged once, and kept narrow: the join of the instances
-- with range_ops and gpu_ops is most of their cost on a trace of a million kernels.
SELECT p.name, p.range_id, o.op_id, o.kind = 'kernel' AS is_kernel, o.start, o."end", o.dur, o.name_id,
       o.short_id
FROM (SELECT name, range_id FROM phase_inst) AS p
JOIN range_ops AS ro USING (range_id)
JOIN gpu_ops AS o ON o.op_id = ro.op_id;
