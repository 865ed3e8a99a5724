-- Question: per workload, what verdict and how much GPU time per repetition? Reads the temp table `dispatch`
-- (the result of verdicts.sql). A workload is fused when every instance is, fallback when any is, native or
-- no-gpu-work when all are, else mixed. GPU time per repetition is busy time (the union of its GPU ops), mean
-- and median; the projected span (mean_proj_gpu_ns) also holds the GPU's idle time inside it.
SELECT
    range,
    any_value(workload) AS workload,
    bool_or(required_fused) AS required_fused,
    count(*) AS instances,
    verdict_over(verdict) AS verdict,  -- stage_macros.sql
    CAST(sum(fused_kernels) AS BIGINT) AS fused_kernels,
    CAST(sum(other_kernels) AS BIGINT) AS other_kernels,
    round(avg(proj_gpu_ns), 1) AS mean_proj_gpu_ns,
    CAST(sum(proj_gpu_ns) AS BIGINT) AS total_proj_gpu_ns,
    round(avg(gpu_busy_ns), 1) AS mean_gpu_busy_ns,
    round(median(gpu_busy_ns), 1) AS med_gpu_busy_ns,
    round(avg(kernel_ns), 1) AS mean_kernel_ns,
    CAST(sum(host_syncs) AS BIGINT) AS host_syncs,
    CAST(sum(dtoh_copies) AS BIGINT) AS dtoh_copies
FROM dispatch
WHERE level = 'workload'
GROUP BY range
ORDER BY range;
