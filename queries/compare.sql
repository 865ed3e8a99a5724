-- Question: what changed against a baseline? Reads base_/cur_ workload summaries and kernel summaries
-- (temp tables with the columns of workload_summary.sql and kernel_summary.sql). Per workload: mean GPU busy
-- time per repetition (the union of its GPU ops, not the projected span) and verdict; per kernel: total time. delta_pct > 0 means slower now.
-- $threshold (percent): a fused workload (required_fused) regresses when slower by more than it, or when it
-- was fused in the baseline and is not now.
WITH wl AS (
    SELECT
        'workload' AS kind,
        coalesce(c.range, b.range) AS name,
        b.mean_gpu_busy_ns AS base_ns,
        c.mean_gpu_busy_ns AS cur_ns,
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
        CAST(b.total_ns AS DOUBLE) AS base_ns,
        CAST(c.total_ns AS DOUBLE) AS cur_ns,
        NULL::VARCHAR AS base_verdict,
        NULL::VARCHAR AS cur_verdict,
        false AS required_fused
    FROM cur_kernels AS c
    FULL OUTER JOIN base_kernels AS b ON b.kernel = c.kernel
),
rows AS (SELECT * FROM wl UNION ALL SELECT * FROM k)
SELECT
    kind, name, base_ns, cur_ns,
    round(100.0 * (cur_ns - base_ns) / nullif(base_ns, 0), 2) AS delta_pct,
    base_verdict, cur_verdict,
    kind = 'workload' AND required_fused AND (
        coalesce(100.0 * (cur_ns - base_ns) / nullif(base_ns, 0) > $threshold, false)
        OR (base_verdict = 'fused' AND coalesce(cur_verdict, 'missing') <> 'fused')
    ) AS regression
FROM rows
ORDER BY kind DESC, regression DESC, abs(coalesce(cur_ns, 0) - coalesce(base_ns, 0)) DESC, name;
