-- Stage: every GPU operation (kernel, memcpy, memset) with the CUDA API call that launched it.
-- An operation's correlationId names the runtime row of the same process (globalTid >> 24 == globalPid >> 24:
-- globalTid packs the pid above its low 24 tid bits); CUDA graph node kernels carry the id of the
-- cudaGraphLaunch call, so they join the same way. Operations without a launch row keep NULL launch columns.
-- Copies keep their kind (copyKind: 1 host to device, 2 device to host, 8 device to device, ...), memory kinds
-- (srcKind/dstKind/memKind: 0 pageable, 1 pinned, 2 device, 4 managed) and devices: host_syncs reads them.
CREATE OR REPLACE TEMP TABLE gpu_ops AS
WITH ops AS (
    SELECT 'kernel' AS kind, start, "end", deviceId, streamId, correlationId, globalPid,
           demangledName AS name_id, shortName AS short_id, NULL::BIGINT AS bytes, NULL::BIGINT AS copy_kind,
           NULL::BIGINT AS src_kind, NULL::BIGINT AS dst_kind, NULL::BIGINT AS src_dev, NULL::BIGINT AS dst_dev,
           NULL::BIGINT AS mem_kind
    FROM src_CUPTI_ACTIVITY_KIND_KERNEL
    UNION ALL
    SELECT 'memcpy', start, "end", deviceId, streamId, correlationId, globalPid, NULL, NULL, bytes, copyKind,
           srcKind, dstKind, srcDeviceId, dstDeviceId, NULL
    FROM src_CUPTI_ACTIVITY_KIND_MEMCPY
    UNION ALL
    SELECT 'memset', start, "end", deviceId, streamId, correlationId, globalPid, NULL, NULL, bytes, NULL,
           NULL, NULL, NULL, NULL, memKind
    FROM src_CUPTI_ACTIVITY_KIND_MEMSET
)
SELECT
    row_number() OVER () AS op_id,
    o.kind, o.start, o."end", o."end" - o.start AS dur, o.deviceId, o.streamId, o.correlationId, o.globalPid,
    coalesce(n.value, '') AS kernel,
    coalesce(sn.value, n.value, '') AS kernel_short,
    r.globalTid AS launch_tid, r.start AS launch_start, r."end" AS launch_end, r.nameId AS api_id,
    o.bytes, o.copy_kind, o.src_kind, o.dst_kind, o.src_dev, o.dst_dev, o.mem_kind,
    o.name_id, o.short_id  -- the names' string ids: the RL-step view groups by them (integers), not the names
FROM ops AS o
LEFT JOIN src_CUPTI_ACTIVITY_KIND_RUNTIME AS r
    ON r.correlationId = o.correlationId AND (r.globalTid >> 24) = (o.globalPid >> 24)
LEFT JOIN src_StringIds AS n ON n.id = o.name_id
LEFT JOIN src_StringIds AS sn ON sn.id = o.short_id;
