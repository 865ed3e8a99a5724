-- Question: where does GPU kernel time go? One row per demangled kernel name, as `nsys stats --report
-- cuda_gpu_kern_sum` computes it: sample standard deviation (0 for one instance), median interpolated between
-- the two middle values, averages rounded to 0.1 ns, time_pct of the summed kernel time.
WITH s AS (
    SELECT
        kernel,
        min(kernel_short) AS kernel_short,
        count(*) AS instances,
        CAST(sum(dur) AS BIGINT) AS total_ns,
        avg(dur) AS avg_ns,
        median(dur) AS med_ns,
        min(dur) AS min_ns,
        max(dur) AS max_ns,
        coalesce(stddev_samp(dur), 0) AS stddev_ns
    FROM gpu_ops
    WHERE kind = 'kernel'
    GROUP BY kernel
)
SELECT
    kernel, kernel_short, instances, total_ns,
    round(avg_ns, 1) AS avg_ns, round(med_ns, 1) AS med_ns, min_ns, max_ns, round(stddev_ns, 1) AS stddev_ns,
    round(total_ns * 100.0 / sum(total_ns) OVER (), 1) AS time_pct
FROM s
ORDER BY total_ns DESC, instances, kernel;
