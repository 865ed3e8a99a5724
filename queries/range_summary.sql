-- Question: how long do the ranges last on the CPU, and how much GPU time do they project?
-- One row per range name and style: instances and range_total_ns as `nsys stats --report nvtx_sum`;
-- proj_total_ns and gpu_ops as `nvtx_gpu_proj_sum` (which sums over instances with a positive projection).
-- Start/end ranges ended on another thread project the process's launches in their window (nsys: none).
SELECT
    range,
    style,
    count(*) AS instances,
    CAST(sum(dur) AS BIGINT) AS range_total_ns,
    CAST(coalesce(sum(proj_ns) FILTER (WHERE proj_ns > 0), 0) AS BIGINT) AS proj_total_ns,
    CAST(coalesce(sum(gpu_ops) FILTER (WHERE proj_ns > 0), 0) AS BIGINT) AS gpu_ops
FROM range_instances
GROUP BY range, style
ORDER BY range_total_ns DESC, range, style;
