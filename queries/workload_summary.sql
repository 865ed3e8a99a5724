-- Question: per workload, what verdict and how much GPU time per repetition? Reads the temp table `dispatch`
-- (the result of verdicts.sql). A workload is fused when every instance is, fallback when any is, native or
-- no-gpu-work when all are, else mixed.
SELECT
    range,
    any_value(workload) AS workload,
    bool_or(required_fused) AS required_fused,
    count(*) AS instances,
    CASE
        WHEN bool_and(verdict = 'fused') THEN 'fused'
        WHEN bool_or(verdict = 'fallback') THEN 'fallback'
        WHEN bool_and(verdict = 'native') THEN 'native'
        WHEN bool_and(verdict = 'no-gpu-work') THEN 'no-gpu-work'
        ELSE 'mixed'
    END AS verdict,
    CAST(sum(fused_kernels) AS BIGINT) AS fused_kernels,
    CAST(sum(other_kernels) AS BIGINT) AS other_kernels,
    round(avg(proj_gpu_ns), 1) AS mean_proj_gpu_ns,
    CAST(sum(proj_gpu_ns) AS BIGINT) AS total_proj_gpu_ns
FROM dispatch
WHERE level = 'workload'
GROUP BY range
ORDER BY range;
