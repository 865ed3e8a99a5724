-- Question: did each op call and each workload repetition run the fused path?
-- Judged per range instance, with its GPU time (stage_range_instances.sql). Op ranges are `rlkernel:op.<op>`; workload ranges are those listed in the temp
-- table workload_spec(range, name, fused_ops, expects_fused), built from the registry, the run manifest and
-- --range. Parameters: $patterns (kernel-name globs that prove the fused path, matched against the short and
-- the demangled name) and $native_ops (ops whose dispatch records say they ran native on purpose). The temp table
-- op_helper_globs(op, pat) holds each op's helper kernels (rlkernel/op_kernels.py: the cuBLAS GEMMs of
-- linear_logp); a kernel counts as a helper only inside a range of that op, never in another op's or a workload's.
--
-- op range: no kernels -> no-gpu-work; at least one fused kernel and every other kernel one of the op's helpers
--   -> fused; fused and other kernels -> mixed; no fused kernel (helpers alone included: a GEMM is not the
--   fused path) -> native when the op ran native on purpose (its workload does not list it in fused_ops;
--   outside any workload: $native_ops), else fallback. other_kernels of an op row leaves its helpers out
--   (helper_kernels counts them).
-- workload range with op ranges: from its fused_ops' op ranges (all fused -> fused, any fallback ->
--   fallback, else mixed; none of them -> no-gpu-work); a workload without fused_ops -> native. Other kernels
--   (a training step's GEMMs) and other ops (a sampler native on purpose) do not count.
-- workload range without op ranges (another program's trace): judged on its own kernels like an op range.
WITH
fused_names AS (
    SELECT g.kernel, bool_or(g.kernel_short GLOB p.pat OR g.kernel GLOB p.pat) AS fused
    FROM (SELECT DISTINCT kernel, kernel_short FROM gpu_ops WHERE kind = 'kernel') AS g
    CROSS JOIN unnest(CAST($patterns AS VARCHAR[])) AS p(pat)
    GROUP BY g.kernel
),
helper_names AS (
    -- (op, kernel) for each kernel name one of the op's helper globs matches (a small table: names x globs)
    SELECT DISTINCT h.op, g.kernel
    FROM (SELECT DISTINCT kernel, kernel_short FROM gpu_ops WHERE kind = 'kernel') AS g
    JOIN op_helper_globs AS h ON g.kernel_short GLOB h.pat OR g.kernel GLOB h.pat
),
helper_ranges AS (
    -- the op ranges of ops that have helpers
    SELECT r.range_id, substr(r.message, 4) AS op
    FROM ranges AS r
    WHERE r.domain = 'rlkernel' AND r.message LIKE 'op.%'
      AND substr(r.message, 4) IN (SELECT op FROM op_helper_globs)
),
inst_kernels AS (
    SELECT ro.range_id,
           count(*) FILTER (WHERE coalesce(f.fused, false)) AS fused_kernels,
           count(*) FILTER (WHERE NOT coalesce(f.fused, false)) AS unfused_kernels,
           count(*) FILTER (WHERE NOT coalesce(f.fused, false) AND h.kernel IS NOT NULL) AS helper_kernels
    FROM range_ops AS ro
    JOIN gpu_ops AS o ON o.op_id = ro.op_id AND o.kind = 'kernel'
    LEFT JOIN fused_names AS f ON f.kernel = o.kernel
    LEFT JOIN helper_ranges AS hr ON hr.range_id = ro.range_id
    LEFT JOIN helper_names AS h ON h.op = hr.op AND h.kernel = o.kernel
    GROUP BY ro.range_id
),
wl AS (
    SELECT i.*, w.name AS workload, w.fused_ops, w.expects_fused,
           coalesce(k.fused_kernels, 0) AS fused_kernels, coalesce(k.unfused_kernels, 0) AS other_kernels
    FROM range_instances AS i
    JOIN workload_spec AS w ON w.range = i.range
    LEFT JOIN inst_kernels AS k ON k.range_id = i.range_id
),
ops AS (
    SELECT i.*, substr(i.message, 4) AS op,
           coalesce(k.fused_kernels, 0) AS fused_kernels,
           coalesce(k.unfused_kernels - k.helper_kernels, 0) AS other_kernels,
           coalesce(k.helper_kernels, 0) AS helper_kernels
    FROM range_instances AS i
    LEFT JOIN inst_kernels AS k ON k.range_id = i.range_id
    WHERE i.domain = 'rlkernel' AND i.message LIKE 'op.%'
),
op_in_wl AS (
    -- The nearest enclosing workload instance of each op instance (push/pop nesting on its thread).
    SELECT o.range_id AS op_range_id, w.range_id AS wl_range_id, w.fused_ops
    FROM ops AS o
    JOIN range_anc AS a ON a.range_id = o.range_id AND a.ancestor_id <> o.range_id
    JOIN wl AS w ON w.range_id = a.ancestor_id
    JOIN range_tree AS t ON t.range_id = w.range_id
    QUALIFY row_number() OVER (PARTITION BY o.range_id ORDER BY t.depth DESC) = 1
),
op_verdicts AS (
    SELECT o.*, x.wl_range_id,
           x.wl_range_id IS NOT NULL AND list_contains(x.fused_ops, o.op) AS required_fused,
           CASE
               WHEN o.fused_kernels + o.other_kernels + o.helper_kernels = 0 THEN 'no-gpu-work'
               WHEN o.fused_kernels > 0 AND o.other_kernels = 0 THEN 'fused'
               WHEN o.fused_kernels > 0 THEN 'mixed'
               WHEN x.wl_range_id IS NOT NULL AND NOT list_contains(x.fused_ops, o.op) THEN 'native'
               WHEN x.wl_range_id IS NULL AND list_contains(CAST($native_ops AS VARCHAR[]), o.op) THEN 'native'
               ELSE 'fallback'
           END AS verdict
    FROM ops AS o
    LEFT JOIN op_in_wl AS x ON x.op_range_id = o.range_id
),
wl_ops AS (
    SELECT wl_range_id,
           count(*) AS n_ops,
           count(*) FILTER (WHERE required_fused) AS n_required,
           count(*) FILTER (WHERE required_fused AND verdict = 'fused') AS n_fused,
           count(*) FILTER (WHERE required_fused AND verdict = 'fallback') AS n_fallback
    FROM op_verdicts
    WHERE wl_range_id IS NOT NULL
    GROUP BY wl_range_id
),
wl_verdicts AS (
    SELECT w.*,
           CASE
               WHEN c.n_ops IS NOT NULL THEN
                   CASE
                       WHEN NOT w.expects_fused THEN
                           CASE WHEN w.fused_kernels + w.other_kernels = 0 THEN 'no-gpu-work' ELSE 'native' END
                       WHEN c.n_required = 0 THEN 'no-gpu-work'
                       WHEN c.n_fused = c.n_required THEN 'fused'
                       WHEN c.n_fallback > 0 THEN 'fallback'
                       ELSE 'mixed'
                   END
               WHEN w.fused_kernels + w.other_kernels = 0 THEN 'no-gpu-work'
               WHEN w.other_kernels = 0 THEN 'fused'
               WHEN w.fused_kernels > 0 THEN 'mixed'
               WHEN w.expects_fused THEN 'fallback'
               ELSE 'native'
           END AS verdict
    FROM wl AS w
    LEFT JOIN wl_ops AS c ON c.wl_range_id = w.range_id
)
SELECT 'workload' AS level, range, instance, start AS start_ns, verdict, fused_kernels, other_kernels,
       0::BIGINT AS helper_kernels, proj_ns AS proj_gpu_ns, kernel_ns, gpu_busy_ns, gpu_idle_ns, host_syncs, dtoh_copies, "end" AS end_ns,
       range_id, workload, expects_fused AS required_fused, NULL::VARCHAR AS in_workload,
       NULL::BIGINT AS in_workload_instance
FROM wl_verdicts
UNION ALL
SELECT 'op', o.range, o.instance, o.start, o.verdict, o.fused_kernels, o.other_kernels, o.helper_kernels, o.proj_ns,
       o.kernel_ns, o.gpu_busy_ns, o.gpu_idle_ns, o.host_syncs, o.dtoh_copies, o."end", o.range_id,
       NULL, o.required_fused, w.range, w.instance
FROM op_verdicts AS o
LEFT JOIN range_instances AS w ON w.range_id = o.wl_range_id
ORDER BY start_ns, level DESC, range;
