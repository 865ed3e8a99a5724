-- Question: what share of each step's wall span does each phase take? One row per (step, phase name): the summed
-- wall span of the phase's instances inside the step over the step's span, in percent (nested phases each count:
-- `loss` holds `policy_forward`, so the shares of one step can add up to more than 100).
SELECT s.range_id AS step_id, p.name, round(100.0 * sum(p.dur) / nullif(any_value(s.dur), 0), 2) AS share_pct,
       min(p.start) AS first_start
FROM phase_inst AS p
JOIN phase_inst AS s ON s.range_id = p.step_id
WHERE NOT p.is_step
GROUP BY s.range_id, p.name
ORDER BY step_id, first_start;
