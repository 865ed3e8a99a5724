-- Question: who computed the log-probs in each phase? Per phase name and family, the GPU time of its log-prob
-- kernels. A kernel inside an rlkernel op.logp / op.linear_logp range ($op_ranges, GLOB) is rlkernel's work on the
-- path that range's verdict names (`rlkernel fused` or `rlkernel native`); any other kernel takes the first
-- family (logprob_globs, lowest rank) one of whose globs its short or demangled name matches.
WITH k AS (
    SELECT DISTINCT p.name, p.range_id, p.tid, o.op_id, o.kernel, o.kernel_short, o.dur, o.launch_start
    FROM phase_inst AS p
    JOIN range_ops AS ro USING (range_id)
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
    WHERE o.kind = 'kernel'
),
in_op AS (
    SELECT DISTINCT ON (k.name, k.op_id) k.name, k.op_id, k.dur,
           CASE WHEN d.verdict = 'fused' THEN 'rlkernel fused' ELSE 'rlkernel native' END AS family, -1 AS rank
    FROM k
    JOIN range_ops AS ro ON ro.op_id = k.op_id
    JOIN range_instances AS i ON i.range_id = ro.range_id
    JOIN dispatch AS d ON d.range_id = i.range_id AND d.level = 'op'
    WHERE list_bool_or([i.range GLOB g FOR g IN $op_ranges])
    ORDER BY k.name, k.op_id, i.start DESC
),
by_name AS (
    SELECT DISTINCT ON (k.name, k.op_id) k.name, k.op_id, k.dur, g.family, g.rank
    FROM k
    JOIN logprob_globs AS g ON k.kernel_short GLOB g.pat OR k.kernel GLOB g.pat
    WHERE NOT EXISTS (SELECT 1 FROM in_op WHERE in_op.name = k.name AND in_op.op_id = k.op_id)
    ORDER BY k.name, k.op_id, g.rank
),
fam AS (SELECT * FROM in_op UNION ALL SELECT * FROM by_name)
SELECT name, family, min(rank) AS rank, count(*) AS kernels, CAST(sum(dur) AS BIGINT) AS total_ns
FROM fam
GROUP BY name, family
ORDER BY name, total_ns DESC, rank;
