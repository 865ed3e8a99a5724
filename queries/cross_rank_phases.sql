-- Question (all ranks): per RL phase and rank, the rank's phase figures beside the others'. Reads rank_list(rank,
-- session_start_ns) and rank_phases (the union of every rank's phases.sql rows, with its rank and ord, the row's
-- position in that rank's phases.csv). Every phase gets a row for every rank: a rank without it has 0 instances
-- and empty figures. A phase is matched across ranks by its name (phases.csv's `name`).
--
-- slowest_rank: the rank with the most wall time in the phase (total_ns, its instances' spans summed; ties: the
--   lower rank); spread: that over the median total of the ranks that have the phase.
-- busiest_rank: the rank with the most GPU busy time in the phase (gpu_busy_ns; none where no rank has any);
--   busy_imbalance: that over the median busy time of the ranks that have the phase; empty where the median is 0.
WITH
names AS (SELECT name, min(phase) AS phase, min(ord) AS ord FROM rank_phases GROUP BY name),
placed AS (
    SELECT n.name, n.phase, n.ord, k.rank, coalesce(p.instances, 0) AS instances, p.total_ns, p.med_ns,
           p.step_share_pct, p.gpu_busy_ns, p.busy_pct, p.host_syncs, p.syncs_per_step, p.logprob_by, p.logprob_ns
    FROM names AS n
    CROSS JOIN rank_list AS k
    LEFT JOIN rank_phases AS p ON p.name = n.name AND p.rank = k.rank
),
per_phase AS (
    SELECT name,
           CASE WHEN max(total_ns) IS NOT NULL THEN first(rank ORDER BY total_ns DESC NULLS LAST, rank) END
               AS slowest_rank,
           max(total_ns) / nullif(median(total_ns), 0) AS spread,
           CASE WHEN max(gpu_busy_ns) > 0 THEN first(rank ORDER BY gpu_busy_ns DESC NULLS LAST, rank) END
               AS busiest_rank,
           max(gpu_busy_ns) / nullif(median(gpu_busy_ns), 0) AS busy_imbalance
    FROM placed
    GROUP BY name
)
SELECT p.name, p.phase, p.rank, p.instances, p.total_ns, p.med_ns, p.step_share_pct, p.gpu_busy_ns, p.busy_pct,
       p.host_syncs, p.syncs_per_step, p.logprob_by, p.logprob_ns, r.slowest_rank, round(r.spread, 4) AS spread,
       r.busiest_rank, round(r.busy_imbalance, 4) AS busy_imbalance
FROM placed AS p
JOIN per_phase AS r USING (name)
ORDER BY p.ord, p.name, p.rank;
