-- Question: how long do the ranges last on the CPU, and how much GPU time do they project?
-- One row per range name and style: instances and range_total_ns as `nsys stats --report nvtx_sum`;
-- proj_total_ns and gpu_ops as `nvtx_gpu_proj_sum` (which sums over instances with a positive projection).
-- Start/end ranges ended on another thread project the process's launches in their window (nsys: none).
-- kernel_ns, gpu_busy_ns, gpu_idle_ns, host_syncs, dtoh_copies: summed over instances (stage_range_instances.sql
-- says what each is); kernel_ns equals nvtx_kern_sum's total over the range's (instance, kernel) pairs.
SELECT
    range,
    style,
    count(*) AS instances,
    CAST(sum(dur) AS BIGINT) AS range_total_ns,
    CAST(coalesce(sum(proj_ns) FILTER (WHERE proj_ns > 0), 0) AS BIGINT) AS proj_total_ns,
    CAST(coalesce(sum(gpu_ops) FILTER (WHERE proj_ns > 0), 0) AS BIGINT) AS gpu_ops,
    CAST(sum(kernel_ns) AS BIGINT) AS kernel_ns,
    CAST(sum(gpu_busy_ns) AS BIGINT) AS gpu_busy_ns,
    CAST(sum(gpu_idle_ns) AS BIGINT) AS gpu_idle_ns,
    CAST(sum(host_syncs) AS BIGINT) AS host_syncs,
    CAST(sum(dtoh_copies) AS BIGINT) AS dtoh_copies
FROM range_instances
GROUP BY range, style
ORDER BY range_total_ns DESC, range, style;
