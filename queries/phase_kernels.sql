-- Question: which kernels take each phase's GPU time? Per phase name, its $top kernels by summed duration (a
-- kernel launched inside two nested instances of one phase counts once). Grouped by the names' string ids
-- (phase_kernel_ops), named afterwards.
WITH k AS (
    SELECT name, short_id, name_id, count(*) AS launches, sum(dur) AS total_ns
    FROM phase_kernel_ops
    GROUP BY name, short_id, name_id
),
named AS (
    SELECT k.name, coalesce(sn.value, n.value, '') AS kernel_short, sum(k.launches) AS launches,
           sum(k.total_ns) AS total_ns
    FROM k
    LEFT JOIN src_StringIds AS n ON n.id = k.name_id
    LEFT JOIN src_StringIds AS sn ON sn.id = k.short_id
    GROUP BY k.name, coalesce(sn.value, n.value, '')
)
SELECT name, kernel_short, CAST(launches AS BIGINT) AS launches, CAST(total_ns AS BIGINT) AS total_ns
FROM named
QUALIFY row_number() OVER (PARTITION BY name ORDER BY total_ns DESC, kernel_short) <= $top
ORDER BY name, total_ns DESC, kernel_short;
