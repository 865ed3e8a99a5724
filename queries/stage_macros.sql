-- Stage: the rules several questions share, as macros (DuckDB expands them where they are used).
--
-- verdict_over(v): the verdict of a range over its instances' verdicts v, an aggregate: fused when every instance
--   is, fallback when any is, native or no-gpu-work when all are, else mixed (workload_summary.sql,
--   cross_rank_partial.sql).
CREATE OR REPLACE TEMP MACRO verdict_over(v) AS
    CASE
        WHEN bool_and(v = 'fused') THEN 'fused'
        WHEN bool_or(v = 'fallback') THEN 'fallback'
        WHEN bool_and(v = 'native') THEN 'native'
        WHEN bool_and(v = 'no-gpu-work') THEN 'no-gpu-work'
        ELSE 'mixed'
    END;
