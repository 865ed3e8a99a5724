/* A minimal NVTX tool for the CPU tests: what nsys sees of a program's NVTX calls, written as text.
 *
 * NVTX loads the library named by NVTX_INJECTION64_PATH at a process's first NVTX call and calls its
 * InitializeInjectionNvtx2, which fills in the CORE2 callbacks (the domain API the `nvtx` package uses): from then
 * on the domain is enabled, as under nsys. Each event is one line appended (one write(2), O_APPEND: lines of
 * several processes do not interleave) to the file named by NVTX_LOG_FILE:
 *
 *   <ns>\t<pid>\t<tid>\tpush\t<domain>\t<message>\t<payload or ->
 *   <ns>\t<pid>\t<tid>\tpop\t<domain>
 *
 * <ns> is CLOCK_MONOTONIC. The types are NVTX3's ABI (nvToolsExt.h, nvtxDetail/nvtxTypes.h), declared here so the
 * test needs only a C compiler, no CUDA headers. Built by tests/nvtx_log.py.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef void (*NvtxFunctionPointer)(void);
typedef NvtxFunctionPointer **NvtxFunctionTable;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, NvtxFunctionTable *out_table, unsigned int *out_size);
} NvtxExportTableCallbacks;
typedef const void *(*NvtxGetExportTableFunc_t)(uint32_t exportTableId);

enum { ETID_CALLBACKS = 1, MODULE_CORE2 = 5 };
enum { CORE2_PUSH = 4, CORE2_POP = 5, CORE2_REGISTER_STRING_A = 10, CORE2_CREATE_A = 12, CORE2_DESTROY = 14 };
enum { MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3 };
enum { PAYLOAD_UINT64 = 1, PAYLOAD_INT64 = 2, PAYLOAD_UINT32 = 4, PAYLOAD_INT32 = 5 };

typedef struct {
    uint16_t version, size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType, reserved0;
    union { uint64_t ull; int64_t ll; double d; uint32_t ui; int32_t i; float f; } payload;
    int32_t messageType;
    union { const char *ascii; const void *unicode; const char *registered; } message;
} EventAttributes;

typedef struct { char *name; } Domain;  /* what a domain handle points to */

static int log_fd = -1;

static void emit(const char *line, int n) {
    if (log_fd >= 0 && n > 0) {
        ssize_t ignored = write(log_fd, line, (size_t)n);
        (void)ignored;
    }
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static const char *domain_name(const void *d) { return d ? ((const Domain *)d)->name : ""; }

static void *create_domain(const char *name) {
    Domain *d = malloc(sizeof *d);
    d->name = strdup(name ? name : "");
    return d;
}

static void destroy_domain(void *d) { (void)d; /* handles stay valid: strings registered in it may be in use */ }

static const char *register_string(const void *domain, const char *s) { (void)domain; return strdup(s ? s : ""); }

static int push(const void *domain, const EventAttributes *a) {
    char line[4096], payload[32] = "-";
    const char *msg = "";
    if (a && (a->messageType == MESSAGE_ASCII || a->messageType == MESSAGE_REGISTERED) && a->message.ascii)
        msg = a->message.ascii;  /* a registered string's handle is the copy register_string made */
    if (a && a->payloadType == PAYLOAD_INT64) snprintf(payload, sizeof payload, "%lld", (long long)a->payload.ll);
    if (a && a->payloadType == PAYLOAD_UINT64) snprintf(payload, sizeof payload, "%llu",
                                                         (unsigned long long)a->payload.ull);
    if (a && a->payloadType == PAYLOAD_INT32) snprintf(payload, sizeof payload, "%d", a->payload.i);
    if (a && a->payloadType == PAYLOAD_UINT32) snprintf(payload, sizeof payload, "%u", a->payload.ui);
    int n = snprintf(line, sizeof line, "%lld\t%d\t%ld\tpush\t%s\t%s\t%s\n", now_ns(), (int)getpid(),
                     (long)syscall(SYS_gettid), domain_name(domain), msg, payload);
    emit(line, n < (int)sizeof line ? n : (int)sizeof line - 1);
    return 0;
}

static int pop(const void *domain) {
    char line[512];
    int n = snprintf(line, sizeof line, "%lld\t%d\t%ld\tpop\t%s\n", now_ns(), (int)getpid(),
                     (long)syscall(SYS_gettid), domain_name(domain));
    emit(line, n < (int)sizeof line ? n : (int)sizeof line - 1);
    return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const char *path = getenv("NVTX_LOG_FILE");
    if (path) log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const NvtxExportTableCallbacks *cb = get_export_table(ETID_CALLBACKS);
    NvtxFunctionTable table = 0;
    unsigned int size = 0;
    if (!cb || !cb->GetModuleFunctionTable(MODULE_CORE2, &table, &size) || size <= CORE2_DESTROY) return 0;
    *table[CORE2_CREATE_A] = (NvtxFunctionPointer)create_domain;
    *table[CORE2_DESTROY] = (NvtxFunctionPointer)destroy_domain;
    *table[CORE2_REGISTER_STRING_A] = (NvtxFunctionPointer)register_string;
    *table[CORE2_PUSH] = (NvtxFunctionPointer)push;
    *table[CORE2_POP] = (NvtxFunctionPointer)pop;
    return 1;
}
