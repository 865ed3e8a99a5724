-- Question: which kernels take each phase's GPU time? Per phase name, its $top kernels by summed duration (a
-- kernel launched inside two nested instances of one phase counts once).
WITH k AS (
    SELECT DISTINCT p.name, o.op_id, o.kernel_short, o.dur
    FROM phase_inst AS p
    JOIN range_ops AS ro USING (range_id)
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
    WHERE o.kind = 'kernel'
)
SELECT name, kernel_short, count(*) AS launches, CAST(sum(dur) AS BIGINT) AS total_ns
FROM k
GROUP BY name, kernel_short
QUALIFY row_number() OVER (PARTITION BY name ORDER BY sum(dur) DESC, kernel_short) <= $top
ORDER BY name, total_ns DESC, kernel_short;
