-- Question (staged as the temp table phase_kernel_ops by pipelines.phase_view): each phase's kernels, a kernel
-- launched inside two nested instances of one phase once (phase_ops' kernel rows, distinct per phase name); read
-- by phase_kernels.sql and phase_logprobs.sql.
SELECT DISTINCT name, op_id, name_id, short_id, dur FROM phase_ops WHERE is_kernel;
