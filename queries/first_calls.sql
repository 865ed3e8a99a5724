-- Question: what does the first call of each op range cost apart from the steady state? Module loading,
-- autotuning and allocator growth land in the first call; they are not the kernel's cost. Per op range name
-- (the temp table dispatch, level op): the first instance's CPU duration, projected span and GPU busy time, and
-- the median of the same over the later instances (NULL when there is only one).
SELECT
    d.range,
    count(*) AS instances,
    any_value(i.dur) FILTER (WHERE d.instance = 1) AS first_dur_ns,
    any_value(d.proj_gpu_ns) FILTER (WHERE d.instance = 1) AS first_proj_ns,
    any_value(d.gpu_busy_ns) FILTER (WHERE d.instance = 1) AS first_busy_ns,
    median(i.dur) FILTER (WHERE d.instance > 1) AS steady_med_dur_ns,
    median(d.proj_gpu_ns) FILTER (WHERE d.instance > 1) AS steady_med_proj_ns,
    median(d.gpu_busy_ns) FILTER (WHERE d.instance > 1) AS steady_med_busy_ns
FROM dispatch AS d
JOIN range_instances AS i USING (range_id)
WHERE d.level = 'op'
GROUP BY d.range
ORDER BY d.range;
