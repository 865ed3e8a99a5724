-- Stage: every NVTX range (push/pop and start/end, both the registered-string and the inline-text forms),
-- named as nsys names them: `<domain>:<message>`, the default domain giving `:<message>`.
-- Domains are per process: a domain-create event (eventType 75) names domainId within its process only.
-- scope: 'thread' for push/pop and for start/end ranges ended on the thread that started them (nsys attributes
-- these to that thread's launches); 'process' for start/end ranges ended on another thread (nsys attributes
-- nothing to them; we attribute the process's launches inside their time window).
-- payload: the event's int64 payload (rlkernel.step() puts the step index there), NULL where none.
-- A range never closed (end NULL) is taken to run to the last NVTX timestamp, as nsys does.
CREATE OR REPLACE TEMP TABLE ranges AS
WITH ev AS (
    SELECT *, globalTid >> 24 AS proc FROM src_NVTX_EVENTS
),
domains AS (
    SELECT ev.domainId, ev.proc, arg_min(coalesce(s.value, ev.text), ev.start) AS domain
    FROM ev LEFT JOIN src_StringIds AS s ON s.id = ev.textId
    WHERE ev.eventType = 75
    GROUP BY ev.domainId, ev.proc
),
bounds AS (  -- over every NVTX event (marks, domain and string registrations too), as nsys's nvtx reports take it
    SELECT max(greatest(start, coalesce("end", start))) AS tmax FROM ev
)
SELECT
    row_number() OVER (ORDER BY ev.start, ev.globalTid, ev."end" DESC) AS range_id,
    coalesce(d.domain, '') || ':' || coalesce(s.value, ev.text, '') AS range,
    coalesce(d.domain, '') AS domain,
    coalesce(s.value, ev.text, '') AS message,
    CASE WHEN ev.eventType IN (59, 70) THEN 'PushPop' ELSE 'StartEnd' END AS style,
    ev.start,
    coalesce(ev."end", (SELECT tmax FROM bounds)) AS "end",
    ev.globalTid AS tid,
    ev.proc,
    CASE WHEN ev.eventType IN (59, 70) OR ev.endGlobalTid IS NULL OR ev.endGlobalTid = ev.globalTid
         THEN 'thread' ELSE 'process' END AS scope,
    ev.int64Value AS payload
FROM ev
LEFT JOIN domains AS d ON d.domainId = ev.domainId AND d.proc = ev.proc
LEFT JOIN src_StringIds AS s ON s.id = ev.textId
WHERE ev.eventType IN (59, 60, 70, 71);
