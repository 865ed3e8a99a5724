-- Stage: the host's blocking CUDA calls, as NVIDIA's expert-system rules (`nsys analyze`, nsys 2025.3) define
-- them, one row per row those rules report:
--   cuda_api_sync      runtime calls named cudaDeviceSynchronize* or cudaStreamSynchronize*;
--   cuda_memcpy_sync   copies made by cudaMemcpy* without `Async`, except host-to-device copies of 64,000 bytes
--                      or less and copies within one device;
--   cuda_memcpy_async  copies made by cudaMemcpy*Async* from or to pageable memory (they block);
--   cuda_memset_sync   sets made by cudaMemset* without `async`, on pinned or managed memory.
-- Name matching is case-insensitive, as SQLite's LIKE in the rules. The rules join a copy to its runtime call by
-- correlationId alone; here within the process too (gpu_ops), which differs only where two processes reuse ids.
-- start/dur are what the rule reports (the runtime call for cuda_api_sync, the GPU operation for the others);
-- tid/call_start/call_end are the blocking host call, which is what ranges are matched against.
CREATE OR REPLACE TEMP TABLE host_syncs AS
WITH names AS (
    SELECT id, value FROM src_StringIds
    WHERE value ILIKE 'cudaDeviceSynchronize%' OR value ILIKE 'cudaStreamSynchronize%'
       OR value ILIKE 'cudaMemcpy%' OR value ILIKE 'cudaMemset%'
),
api AS (
    SELECT 'cuda_api_sync' AS rule, n.value AS api, r.globalTid AS tid, r.start AS call_start,
           r."end" AS call_end, r.start, r."end" - r.start AS dur, NULL::BIGINT AS op_id
    FROM src_CUPTI_ACTIVITY_KIND_RUNTIME AS r
    JOIN names AS n ON n.id = r.nameId
    WHERE n.value ILIKE 'cudaDeviceSynchronize%' OR n.value ILIKE 'cudaStreamSynchronize%'
),
ops AS (
    SELECT
        CASE
            WHEN o.kind = 'memcpy' AND n.value ILIKE 'cudaMemcpy%' AND n.value NOT ILIKE '%Async%'
                 AND NOT (o.bytes <= 64000 AND o.copy_kind = 1)
                 AND NOT (o.src_dev IS NOT NULL AND o.src_dev = o.dst_dev) THEN 'cuda_memcpy_sync'
            WHEN o.kind = 'memcpy' AND n.value ILIKE 'cudaMemcpy%Async%'
                 AND (o.src_kind = 0 OR o.dst_kind = 0) THEN 'cuda_memcpy_async'
            WHEN o.kind = 'memset' AND n.value ILIKE 'cudaMemset%' AND n.value NOT ILIKE '%async%'
                 AND (o.mem_kind = 1 OR o.mem_kind = 4) THEN 'cuda_memset_sync'
        END AS rule,
        n.value AS api, o.launch_tid, o.launch_start, o.launch_end, o.start, o.dur, o.op_id
    FROM gpu_ops AS o
    JOIN names AS n ON n.id = o.api_id
    WHERE o.kind <> 'kernel'
)
SELECT row_number() OVER (ORDER BY call_start, rule, op_id) AS sync_id, *
FROM (SELECT * FROM api UNION ALL SELECT * FROM ops WHERE rule IS NOT NULL);
