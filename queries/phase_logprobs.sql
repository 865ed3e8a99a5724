-- Question: who computed the log-probs in each phase? Per phase name and family, the GPU time of its log-prob
-- kernels. A kernel inside an rlkernel op.logp / op.linear_logp range ($op_ranges, GLOB) is rlkernel's work on the
-- path that range's verdict names (`rlkernel fused` or `rlkernel native`; the innermost such range, should they
-- nest); any other kernel takes the first family (logprob_globs, lowest rank) one of whose globs its short or
-- demangled name matches. The globs are matched once per distinct kernel name (gpu_ops' string ids), the op ranges' kernels found from
-- the op ranges (few) rather than from every kernel's ranges: both bound the cost on a million kernels.
WITH
k AS (SELECT * FROM phase_kernel_ops),  -- each phase's kernels, once per phase name
op_ranges AS (
    SELECT i.range_id, i.start, CASE WHEN d.verdict = 'fused' THEN 'rlkernel fused' ELSE 'rlkernel native' END
               AS family
    FROM dispatch AS d
    JOIN range_instances AS i ON i.range_id = d.range_id
    WHERE d.level = 'op' AND list_bool_or([i.range GLOB g FOR g IN $op_ranges])
),
in_op AS (
    SELECT DISTINCT ON (ro.op_id) ro.op_id, r.family
    FROM op_ranges AS r
    JOIN range_ops AS ro USING (range_id)
    ORDER BY ro.op_id, r.start DESC
),
ids AS (SELECT DISTINCT name_id, short_id FROM k),
by_name AS (  -- each distinct (demangled, short) name pair once: its first family
    SELECT DISTINCT ON (i.name_id, i.short_id) i.name_id, i.short_id, g.family, g.rank
    FROM ids AS i
    LEFT JOIN src_StringIds AS n ON n.id = i.name_id
    LEFT JOIN src_StringIds AS sn ON sn.id = i.short_id
    JOIN logprob_globs AS g ON coalesce(sn.value, n.value, '') GLOB g.pat OR coalesce(n.value, '') GLOB g.pat
    ORDER BY i.name_id, i.short_id, g.rank
),
fam AS (
    SELECT k.name, k.dur, coalesce(o.family, b.family) AS family, CASE WHEN o.family IS NOT NULL THEN -1
                                                                     ELSE b.rank END AS rank
    FROM k
    LEFT JOIN in_op AS o ON o.op_id = k.op_id
    LEFT JOIN by_name AS b ON b.name_id IS NOT DISTINCT FROM k.name_id AND b.short_id IS NOT DISTINCT FROM
                                                                           k.short_id
    WHERE o.family IS NOT NULL OR b.family IS NOT NULL
)
SELECT name, family, min(rank) AS rank, count(*) AS kernels, CAST(sum(dur) AS BIGINT) AS total_ns
FROM fam
GROUP BY name, family
ORDER BY name, total_ns DESC, rank;
