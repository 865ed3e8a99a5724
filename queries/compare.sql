-- Question: what changed against a baseline, per instance? Reads base_/cur_ workload summaries and kernel
-- summaries (temp tables with the columns of workload_summary.sql and kernel_summary.sql). Each side's instance
-- count and median time per instance: per workload, the median GPU busy time of its repetitions (the union of
-- their GPU ops, not the projected span); per kernel, the median duration of its launches. Totals are not
-- compared: they move with the instance count. delta_pct > 0 means slower per instance now.
-- $threshold (percent): a fused workload (required_fused) regresses when its median is slower by more than it,
-- or when it was fused in the baseline and is not now. Kernels are reported, never gated.
WITH wl AS (
    SELECT
        'workload' AS kind,
        coalesce(c.range, b.range) AS name,
        b.instances AS base_instances,
        c.instances AS cur_instances,
        b.med_gpu_busy_ns AS base_med_ns,
        c.med_gpu_busy_ns AS cur_med_ns,
        b.verdict AS base_verdict,
        c.verdict AS cur_verdict,
        coalesce(c.required_fused, b.required_fused, false) AS required_fused
    FROM cur_workloads AS c
    FULL OUTER JOIN base_workloads AS b ON b.range = c.range
),
k AS (
    SELECT
        'kernel' AS kind,
        coalesce(c.kernel, b.kernel) AS name,
        b.instances AS base_instances,
        c.instances AS cur_instances,
        CAST(b.med_ns AS DOUBLE) AS base_med_ns,
        CAST(c.med_ns AS DOUBLE) AS cur_med_ns,
        NULL::VARCHAR AS base_verdict,
        NULL::VARCHAR AS cur_verdict,
        false AS required_fused
    FROM cur_kernels AS c
    FULL OUTER JOIN base_kernels AS b ON b.kernel = c.kernel
),
rows AS (SELECT * FROM wl UNION ALL SELECT * FROM k)
SELECT
    kind, name, base_instances, cur_instances, base_med_ns, cur_med_ns,
    round(100.0 * (cur_med_ns - base_med_ns) / nullif(base_med_ns, 0), 2) AS delta_pct,
    base_verdict, cur_verdict,
    kind = 'workload' AND required_fused AND (
        coalesce(100.0 * (cur_med_ns - base_med_ns) / nullif(base_med_ns, 0) > $threshold, false)
        OR (base_verdict = 'fused' AND coalesce(cur_verdict, 'missing') <> 'fused')
    ) AS regression
FROM rows
ORDER BY kind DESC, regression DESC, abs(coalesce(cur_med_ns, 0) - coalesce(base_med_ns, 0)) DESC, name;
