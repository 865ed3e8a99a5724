-- Question: how close to the memory's peak does each workload run? For workloads whose bytes are known
-- (manifest_workloads: name, bytes), GB/s = bytes moved per repetition / mean GPU busy time per repetition
-- (bytes per ns = GB/s; busy time, the union of the repetition's GPU ops, not its projected span, which also
-- holds idle time), against TARGET_INFO_GPU.memoryBandwidth (bytes/s; the first GPU: one-GPU
-- captures). ncu columns (temp table ncu_metrics, the run's ncu.csv; empty without one) are per repetition:
-- DRAM bytes read + written and kernel time summed over the repetition's launches, averaged over repetitions.
WITH
w AS (
    SELECT s.range, s.workload, s.instances, s.mean_proj_gpu_ns, s.mean_gpu_busy_ns, m.bytes
    FROM workload_summary AS s
    JOIN manifest_workloads AS m ON m.name = s.workload
    WHERE m.bytes > 0
),
peak AS (
    SELECT memoryBandwidth / 1e9 AS peak_gb_per_s FROM src_TARGET_INFO_GPU ORDER BY id LIMIT 1
),
ncu_rep AS (
    SELECT range AS workload, instance,
           sum(value) FILTER (WHERE metric IN ('dram__bytes_read.sum', 'dram__bytes_write.sum')) AS dram_bytes,
           sum(value) FILTER (WHERE metric = 'gpu__time_duration.sum') AS gpu_time_ns,
           avg(value) FILTER (WHERE metric = 'dram__throughput.avg.pct_of_peak_sustained_elapsed') AS dram_pct,
           count(DISTINCT launch) AS launches
    FROM ncu_metrics
    GROUP BY range, instance
),
ncu AS (
    SELECT workload, avg(dram_bytes) AS dram_bytes, avg(gpu_time_ns) AS gpu_time_ns, avg(dram_pct) AS dram_pct,
           avg(launches) AS launches
    FROM ncu_rep GROUP BY workload
)
SELECT
    w.workload,
    w.instances,
    w.bytes,
    w.mean_proj_gpu_ns,
    w.mean_gpu_busy_ns,
    round(w.bytes / nullif(w.mean_gpu_busy_ns, 0), 2) AS gb_per_s,
    round(p.peak_gb_per_s, 1) AS peak_gb_per_s,
    round(100.0 * w.bytes / nullif(w.mean_gpu_busy_ns, 0) / nullif(p.peak_gb_per_s, 0), 1) AS pct_of_peak,
    round(n.launches, 1) AS ncu_launches,
    round(n.dram_bytes, 0) AS ncu_dram_bytes,
    round(n.gpu_time_ns, 0) AS ncu_gpu_time_ns,
    round(n.dram_bytes / nullif(n.gpu_time_ns, 0), 2) AS ncu_gb_per_s,
    round(n.dram_pct, 1) AS ncu_dram_pct_of_peak
FROM w
LEFT JOIN peak AS p ON true
LEFT JOIN ncu AS n ON n.workload = w.workload
ORDER BY w.workload;
