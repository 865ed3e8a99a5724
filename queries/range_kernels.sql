-- Question: which kernels run inside which ranges? As `nsys stats --report nvtx_kern_sum`: a kernel counts
-- for every range open around its launch call; statistics are over (range instance, kernel) pairs, so a
-- kernel inside two nested instances of one name counts twice in total_ns (kernel_instances counts it once).
-- Kernels outside every thread-scoped range form rows with an empty range and style, as nsys writes them;
-- a trace without any NVTX range has no rows at all (nsys skips the report: "does not contain NVTX data").
-- nsys also splits rows by PID and TID; these rows are per range name, style and kernel.
WITH pairs AS (
    SELECT r.range, r.style, o.op_id, o.kernel, o.kernel_short, o.dur
    FROM range_ops AS ro
    JOIN ranges AS r ON r.range_id = ro.range_id
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
    WHERE o.kind = 'kernel'
    UNION ALL
    SELECT '' AS range, '' AS style, o.op_id, o.kernel, o.kernel_short, o.dur
    FROM gpu_ops AS o
    WHERE o.kind = 'kernel'
      AND EXISTS (SELECT 1 FROM ranges)
      AND NOT EXISTS (
        SELECT 1 FROM range_ops AS ro JOIN ranges AS r ON r.range_id = ro.range_id
        WHERE ro.op_id = o.op_id AND r.scope = 'thread')
)
SELECT
    range, style, kernel, min(kernel_short) AS kernel_short,
    count(DISTINCT op_id) AS kernel_instances,
    CAST(sum(dur) AS BIGINT) AS total_ns,
    round(avg(dur), 1) AS avg_ns,
    round(median(dur), 1) AS med_ns,
    min(dur) AS min_ns,
    max(dur) AS max_ns,
    round(coalesce(stddev_samp(dur), 0), 1) AS stddev_ns
FROM pairs
GROUP BY range, style, kernel
ORDER BY range, style, total_ns DESC, kernel;
