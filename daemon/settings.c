/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <math.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/settings.h"
#include "engine/backend.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"

enum opt_type { OPT_PATH, OPT_INT, OPT_SIZE, OPT_SECONDS, OPT_BACKEND, OPT_NUMERICS, OPT_LEVEL,
                OPT_USERS, OPT_GROUPS, OPT_OFFLOAD, OPT_GPUS };

struct opt {
    const char *key;            /* file spelling; the flag is --key with '_' -> '-' */
    enum opt_type type;
    size_t offset;
    size_t size;                /* OPT_PATH: buffer size */
    int64_t min, max;           /* OPT_INT, OPT_SIZE */
    const char *arg, *help;
};

#define F(field) offsetof(struct dsv4_settings, field)
#define PATHOPT(k, field, a, h) { k, OPT_PATH, F(field), sizeof(((struct dsv4_settings *)0)->field), 0, 0, a, h }
#define DSV4_STR_(x) #x
#define DSV4_STR(x) DSV4_STR_(x)
#define INTOPT(k, field, lo, hi, h) { k, OPT_INT, F(field), 0, lo, hi, "N", h }

/* Upper bounds keep a typo from sizing absurd allocations; the engine checks what fits. */
static const struct opt opts[] = {
    PATHOPT("model", model, "DIR", "model directory (config.json, *.safetensors, tokenizer.json)"),
    PATHOPT("tokenizer", tokenizer, "FILE", "tokenizer.json (default: MODEL/tokenizer.json)"),
    { "backend", OPT_BACKEND, F(backend), 0, 0, 0, "cpu|cuda|auto", "compute backend; auto = cuda when usable, else cpu (logged)" },
    { "numerics", OPT_NUMERICS, F(numerics), 0, 0, 0, "exact|fp8|auto", "cache numerics; auto = fp8 for quantized checkpoints" },
    PATHOPT("listen", listen, "PATH", "listen on this Unix socket instead of socket activation"),
    INTOPT("threads", threads, 0, 1024, "CPU backend and sampler threads (0 = the online CPUs)"),
    { "gpus", OPT_GPUS, F(gpus), 0, 0, 0, "N,...|all",
      "CUDA devices by ordinal, up to " DSV4_STR(DSV4_EP_MAX_GPUS) " (default all visible: device 0 runs the "
      "model); two or more split the routed experts across them" },
    INTOPT("max_batch", max_batch, 1, 1024, "sequence slots (requests decoded together)"),
    INTOPT("max_context", max_context, 16, 1 << 20, "tokens per slot (prompt + generated)"),
    { "prefix_cache", OPT_SIZE, F(prefix_cache), 0, 0, (int64_t)1 << 40, "BYTES",
      "prefix-cache pool reserved at boot, GPU memory on CUDA (K/M/G suffixes; 0 = off)" },
    INTOPT("prefill_chunk", prefill_chunk, 0, DSV4_PREFILL_CHUNK_MAX,
           "prompt tokens prefilled per engine step, all requests together; on CUDA one step's rows "
           "(0 = " DSV4_STR(DSV4_PREFILL_CHUNK_DEFAULT) "; running streams wait for at most one such step "
           "between tokens)"),
    INTOPT("decode_stall_ms", decode_stall_ms, 0, DSV4_SCHED_DECODE_STALL_MS_MAX,
           "while streams generate, a step prefills only what the measured prefill rate fits in this many "
           "ms (at least " DSV4_STR(DSV4_SCHED_STALL_MIN_TOKENS) " tokens), bounding their time per token "
           "(0 = off: a whole prefill_chunk)"),
    INTOPT("spec_tokens", spec_tokens, 0, DSV4_SPEC_TOKENS_MAX,
           "speculative decoding: tokens the checkpoint's MTP block drafts per step and one batched step "
           "verifies (0 = off; the output is the same either way)"),
    { "expert_offload", OPT_OFFLOAD, F(expert_offload), 0, 0, 0, "auto|on|off",
      "CUDA: routed experts that do not fit the GPU live in pinned host memory (auto); off refuses to boot" },
    INTOPT("expert_host_share", expert_host_share, 0, 100,
           "with expert_offload = on: percent of each layer's experts kept in host memory even when they fit"),
    PATHOPT("expert_placement", expert_placement, "FILE",
            "routing statistics (a routing_stats file) putting the most routed experts on the GPU (default: even)"),
    PATHOPT("routing_stats", routing_stats, "FILE", "write per-layer, per-expert routed-token counts here at stop"),
    INTOPT("max_connections", max_connections, 1, 65536, "clients connected at once"),
    INTOPT("max_queued", max_queued, 1, 1 << 20, "requests waiting for a slot, all clients together"),
    INTOPT("max_requests_per_conn", max_requests_per_conn, 1, 65536, "requests in flight on one connection"),
    INTOPT("max_prompt_tokens", max_prompt_tokens, 0, 1 << 20, "prompt tokens per request (0 = max_context - 1)"),
    { "max_frame", OPT_SIZE, F(max_frame), 0, 1024, (int64_t)1 << 30, "BYTES", "largest frame a client may send (K/M/G suffixes)" },
    { "max_output_buffer", OPT_SIZE, F(max_output_buffer), 0, 65536, (int64_t)1 << 32, "BYTES",
      "bytes queued for a client that does not read before it is disconnected" },
    { "frame_timeout", OPT_SECONDS, F(frame_timeout), 0, 0, 0, "SECONDS",
      "a client holding part of a frame this long is disconnected (0 = never)" },
    INTOPT("max_idle_per_uid", max_idle_per_uid, 0, 65536,
           "connections one uid may hold with no generate in flight (0 = no limit)"),
    { "drain_grace", OPT_SECONDS, F(drain_grace), 0, 0, 0, "SECONDS",
      "on SIGTERM, time running requests get to finish (queued ones are cancelled)" },
    INTOPT("warmup_tokens", warmup_tokens, 1, 1024, "tokens the boot warm-up generates before READY=1"),
    { "allow_users", OPT_USERS, F(allow_users), 0, 0, 0, "USER,...", "only these users (names or uids) may connect" },
    { "allow_groups", OPT_GROUPS, F(allow_groups), 0, 0, 0, "GROUP,...", "only members of these groups (primary or supplementary) may connect" },
    { "log_level", OPT_LEVEL, F(log_level), 0, 0, 0, "LEVEL", "err|warning|notice|info|debug" },
};

#define N_OPTS (sizeof(opts) / sizeof(opts[0]))

void dsv4_settings_defaults(struct dsv4_settings *s)
{
    memset(s, 0, sizeof(*s));
    s->backend = DSV4_BACKEND_AUTO;
    s->numerics = DSV4_NUMERICS_CHOICE_AUTO;
    s->threads = 0;
    s->max_batch = 8;
    s->max_context = 4096;
    s->prefix_cache = 1u << 30;
    s->max_connections = 256;
    s->max_queued = 256;
    s->max_requests_per_conn = 16;
    s->max_prompt_tokens = 0;
    s->max_frame = 8u << 20;
    s->max_output_buffer = 64u << 20;
    s->frame_timeout = 30.0;
    s->max_idle_per_uid = 64;
    s->drain_grace = 30.0;
    s->warmup_tokens = 4;
    s->log_level = LOG_INFO;
}

const char *dsv4_settings_backend_name(enum dsv4_backend_choice b)
{
    switch (b) {
    case DSV4_BACKEND_CPU: return "cpu";
    case DSV4_BACKEND_CUDA: return "cuda";
    default: return "auto";
    }
}

static const char *offload_name(enum dsv4_expert_offload m)
{
    switch (m) {
    case DSV4_EXPERT_OFFLOAD_ON: return "on";
    case DSV4_EXPERT_OFFLOAD_OFF: return "off";
    default: return "auto";
    }
}

static const char *numerics_name(enum dsv4_numerics_choice n)
{
    switch (n) {
    case DSV4_NUMERICS_CHOICE_EXACT: return "exact";
    case DSV4_NUMERICS_CHOICE_FP8: return "fp8";
    default: return "auto";
    }
}

/* max_batch and max-batch are the same key. */
static const struct opt *find_opt(const char *key)
{
    for (size_t i = 0; i < N_OPTS; i++) {
        const char *a = opts[i].key, *b = key;
        while (*a && (*a == *b || (*a == '_' && *b == '-'))) {
            a++;
            b++;
        }
        if (!*a && !*b)
            return &opts[i];
    }
    return NULL;
}

static int parse_i64(const char *v, int64_t *ret)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v)
        return -EINVAL;
    *ret = x;
    return (int)(end - v);
}

static int parse_size(const char *v, int64_t *ret)
{
    int64_t x;
    int n = parse_i64(v, &x);
    if (n < 0 || x < 0)
        return -EINVAL;
    const char *suffix = v + n;
    int shift = 0;
    switch (*suffix) {
    case '\0': break;
    case 'k': case 'K': shift = 10; suffix++; break;
    case 'm': case 'M': shift = 20; suffix++; break;
    case 'g': case 'G': shift = 30; suffix++; break;
    default: return -EINVAL;
    }
    if (*suffix == 'i' && shift)
        suffix++;
    if (*suffix == 'B' || *suffix == 'b')
        suffix++;
    if (*suffix || x > (INT64_MAX >> shift))
        return -EINVAL;
    *ret = x << shift;
    return 0;
}

/* Comma-separated user or group names (or numeric ids), resolved now so a typo fails at boot. */
static int parse_id_list(const char *v, bool users, uint32_t *ids, int *count, const char *where)
{
    char buf[DSV4_SETTINGS_LINE_MAX];
    char *save = NULL;
    int n = 0;

    if (strlen(v) >= sizeof(buf))
        return dsv4_error_set(-EINVAL, "%s: list too long", where);
    strcpy(buf, v);
    for (char *tok = strtok_r(buf, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save)) {
        int64_t id = -1;
        if (n >= DSV4_SETTINGS_ALLOW_MAX)
            return dsv4_error_set(-E2BIG, "%s: more than %d entries", where, DSV4_SETTINGS_ALLOW_MAX);
        if (parse_i64(tok, &id) == (int)strlen(tok)) {
            if (id < 0 || id > UINT32_MAX - 1)
                return dsv4_error_set(-ERANGE, "%s: id %s out of range", where, tok);
        } else if (users) {
            struct passwd *pw = getpwnam(tok);
            if (!pw)
                return dsv4_error_set(-ENOENT, "%s: no such user '%s'", where, tok);
            id = pw->pw_uid;
        } else {
            struct group *gr = getgrnam(tok);
            if (!gr)
                return dsv4_error_set(-ENOENT, "%s: no such group '%s'", where, tok);
            id = gr->gr_gid;
        }
        ids[n++] = (uint32_t)id;
    }
    *count = n;
    return 0;
}

/* "all", or up to DSV4_EP_MAX_GPUS distinct device ordinals separated by commas. */
static int parse_gpus(struct dsv4_settings *s, const char *v, const char *where)
{
    int gpus[DSV4_EP_MAX_GPUS], n = 0;
    const char *p = v;

    if (!strcmp(v, "all")) {
        s->n_gpus = 0;
        memset(s->gpus, 0, sizeof(s->gpus));
        return 0;
    }
    for (;;) {
        char *end;
        while (*p == ' ' || *p == '\t')
            p++;
        if (!isdigit((unsigned char)*p) && *p != '-')
            return dsv4_error_set(-EINVAL, "%s: gpus = '%s': expected all or device ordinals like 0,1", where, v);
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p)
            return dsv4_error_set(-EINVAL, "%s: gpus = '%s': expected all or device ordinals like 0,1", where, v);
        /* named as written: one past long's range is out of range too, not malformed */
        if (errno == ERANGE || x < 0 || x > DSV4_SETTINGS_GPU_ORDINAL_MAX)
            return dsv4_error_set(-ERANGE, "%s: gpus: device %.*s outside [0, %d]", where, (int)(end - p), p,
                                  DSV4_SETTINGS_GPU_ORDINAL_MAX);
        for (int i = 0; i < n; i++)
            if (gpus[i] == (int)x)
                return dsv4_error_set(-EINVAL, "%s: gpus: device %ld listed twice", where, x);
        if (n == DSV4_EP_MAX_GPUS)
            return dsv4_error_set(-E2BIG, "%s: gpus: more than %d devices", where, DSV4_EP_MAX_GPUS);
        gpus[n++] = (int)x;
        p = end;
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p == '\0')
            break;
        if (*p++ != ',')
            return dsv4_error_set(-EINVAL, "%s: gpus = '%s': expected all or device ordinals like 0,1", where, v);
    }
    memset(s->gpus, 0, sizeof(s->gpus));
    memcpy(s->gpus, gpus, (size_t)n * sizeof(int));
    s->n_gpus = n;
    return 0;
}

/* Apply one key = value; key in file spelling (max_batch) or flag spelling (max-batch).
 * where names the origin for messages ("dsv4d.conf:12", "--max-batch"). */
static int dsv4_settings_set(struct dsv4_settings *s, const char *key, const char *value, const char *where)
{
    const struct opt *o = find_opt(key);
    char *field;
    int64_t x;
    int r;

    if (!o)
        return dsv4_error_set(-EINVAL, "%s: unknown setting '%s'", where, key);
    key = o->key;   /* messages name the setting as the config file spells it */
    field = (char *)s + o->offset;
    switch (o->type) {
    case OPT_PATH:
        if (strlen(value) >= o->size)
            return dsv4_error_set(-ENAMETOOLONG, "%s: %s longer than %zu bytes", where, key, o->size - 1);
        strcpy(field, value);
        return 0;
    case OPT_INT:
        r = parse_i64(value, &x);
        if (r < 0 || value[r] != '\0')
            return dsv4_error_set(-EINVAL, "%s: %s = '%s' is not an integer", where, key, value);
        if (x < o->min || x > o->max)
            return dsv4_error_set(-ERANGE, "%s: %s = %" PRId64 " outside [%" PRId64 ", %" PRId64 "]",
                                  where, key, x, o->min, o->max);
        *(int *)field = (int)x;
        return 0;
    case OPT_SIZE:
        if (parse_size(value, &x) < 0)
            return dsv4_error_set(-EINVAL, "%s: %s = '%s' is not a size (e.g. 8M)", where, key, value);
        if (x < o->min || x > o->max)
            return dsv4_error_set(-ERANGE, "%s: %s = %" PRId64 " outside [%" PRId64 ", %" PRId64 "]",
                                  where, key, x, o->min, o->max);
        *(uint64_t *)field = (uint64_t)x;
        return 0;
    case OPT_SECONDS: {
        char *end;
        double d = strtod(value, &end);
        if (end == value || *end || !isfinite(d) || d < 0 || d > 86400)
            return dsv4_error_set(-EINVAL, "%s: %s = '%s' is not a number of seconds in [0, 86400]",
                                  where, key, value);
        *(double *)field = d;
        return 0;
    }
    case OPT_BACKEND:
        if (!strcmp(value, "cpu"))
            s->backend = DSV4_BACKEND_CPU;
        else if (!strcmp(value, "cuda"))
            s->backend = DSV4_BACKEND_CUDA;
        else if (!strcmp(value, "auto"))
            s->backend = DSV4_BACKEND_AUTO;
        else
            return dsv4_error_set(-EINVAL, "%s: backend = '%s': expected cpu, cuda or auto", where, value);
        return 0;
    case OPT_NUMERICS:
        if (!strcmp(value, "exact"))
            s->numerics = DSV4_NUMERICS_CHOICE_EXACT;
        else if (!strcmp(value, "fp8"))
            s->numerics = DSV4_NUMERICS_CHOICE_FP8;
        else if (!strcmp(value, "auto"))
            s->numerics = DSV4_NUMERICS_CHOICE_AUTO;
        else
            return dsv4_error_set(-EINVAL, "%s: numerics = '%s': expected exact, fp8 or auto", where, value);
        return 0;
    case OPT_OFFLOAD:
        if (!strcmp(value, "auto"))
            s->expert_offload = DSV4_EXPERT_OFFLOAD_AUTO;
        else if (!strcmp(value, "on"))
            s->expert_offload = DSV4_EXPERT_OFFLOAD_ON;
        else if (!strcmp(value, "off"))
            s->expert_offload = DSV4_EXPERT_OFFLOAD_OFF;
        else
            return dsv4_error_set(-EINVAL, "%s: expert_offload = '%s': expected auto, on or off", where, value);
        return 0;
    case OPT_LEVEL:
        r = dsv4_log_parse_level(value);
        if (r < 0)
            return dsv4_error_set(-EINVAL, "%s: log_level = '%s': expected err, warning, notice, info or debug",
                                  where, value);
        s->log_level = r;
        return 0;
    case OPT_GPUS:
        return parse_gpus(s, value, where);
    case OPT_USERS:
        return parse_id_list(value, true, (uint32_t *)s->allow_users, &s->n_allow_users, where);
    case OPT_GROUPS:
        return parse_id_list(value, false, (uint32_t *)s->allow_groups, &s->n_allow_groups, where);
    }
    return -EINVAL;
}

static char *trim(char *p)
{
    char *e;
    while (isspace((unsigned char)*p))
        p++;
    e = p + strlen(p);
    while (e > p && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return p;
}

int dsv4_settings_load_file(struct dsv4_settings *s, const char *path, bool must_exist)
{
    char line[DSV4_SETTINGS_LINE_MAX], where[DSV4_SETTINGS_PATH_MAX + 32];
    FILE *f = fopen(path, "re");
    int lineno = 0, r = 0;

    if (!f) {
        if (errno == ENOENT && !must_exist)
            return 0;
        return dsv4_error_set(-errno, "config %s: %s", path, strerror(errno));
    }
    while (fgets(line, sizeof(line), f)) {
        char *key, *value, *eq;
        lineno++;
        snprintf(where, sizeof(where), "%s:%d", path, lineno);
        if (!strchr(line, '\n') && !feof(f)) {
            r = dsv4_error_set(-EINVAL, "%s: line longer than %d bytes", where, DSV4_SETTINGS_LINE_MAX - 1);
            break;
        }
        key = trim(line);
        if (*key == '\0' || *key == '#' || *key == ';')
            continue;
        eq = strchr(key, '=');
        if (!eq) {
            r = dsv4_error_set(-EINVAL, "%s: expected 'key = value'", where);
            break;
        }
        *eq = '\0';
        value = eq + 1;
        /* "key = value   # comment": a '#' after whitespace starts a comment. */
        for (char *h = strchr(value, '#'); h; h = strchr(h + 1, '#'))
            if (h > value && isspace((unsigned char)h[-1])) {
                *h = '\0';
                break;
            }
        value = trim(value);
        key = trim(key);
        r = dsv4_settings_set(s, key, value, where);
        if (r < 0)
            break;
    }
    if (r == 0 && ferror(f))
        r = dsv4_error_set(-EIO, "config %s: read error", path);
    fclose(f);
    if (r == 0 && strlen(path) < sizeof(s->config_path))
        strcpy(s->config_path, path);
    return r;
}

/* --name=value or --name value. */
static int flag_value(int argc, char **argv, int *i, const char *name, const char **ret)
{
    const char *eq = strchr(argv[*i], '=');
    if (eq) {
        *ret = eq + 1;
        return 0;
    }
    if (*i + 1 >= argc)
        return dsv4_error_set(-EINVAL, "--%s needs a value", name);
    *ret = argv[++*i];
    return 0;
}

int dsv4_settings_from_args(struct dsv4_settings *s, int argc, char **argv, const char *default_path,
                            enum dsv4_settings_action *ret_action)
{
    const char *config = default_path;
    bool explicit_config = false;
    char name[64];
    int r;

    *ret_action = DSV4_SETTINGS_RUN;
    dsv4_settings_defaults(s);

    /* The file first, whatever the flags' order, so flags always win. */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") || !strncmp(argv[i], "--config=", 9)) {
            r = flag_value(argc, argv, &i, "config", &config);
            if (r < 0)
                return r;
            explicit_config = true;
        }
    }
    if (config && *config) {
        r = dsv4_settings_load_file(s, config, explicit_config);
        if (r < 0)
            return r;
    }

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *value;
        size_t len;
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            *ret_action = DSV4_SETTINGS_HELP;
            return 0;
        }
        if (!strcmp(arg, "--version")) {
            *ret_action = DSV4_SETTINGS_VERSION;
            return 0;
        }
        if (!strcmp(arg, "--print-config")) {
            *ret_action = DSV4_SETTINGS_PRINT;
            continue;
        }
        if (strncmp(arg, "--", 2) != 0)
            return dsv4_error_set(-EINVAL, "unexpected argument '%s' (try --help)", arg);
        len = strcspn(arg + 2, "=");
        if (len >= sizeof(name))
            return dsv4_error_set(-EINVAL, "unknown option '%s' (try --help)", arg);
        memcpy(name, arg + 2, len);
        name[len] = '\0';
        if (!strcmp(name, "config")) {
            r = flag_value(argc, argv, &i, name, &value);
            if (r < 0)
                return r;
            continue;
        }
        if (!find_opt(name))
            return dsv4_error_set(-EINVAL, "unknown option '%s' (try --help)", arg);
        r = flag_value(argc, argv, &i, name, &value);
        if (r < 0)
            return r;
        char where[80];
        snprintf(where, sizeof(where), "--%s", name);
        r = dsv4_settings_set(s, name, value, where);
        if (r < 0)
            return r;
    }
    return 0;
}

int dsv4_settings_prompt_limit(const struct dsv4_settings *s)
{
    int limit = s->max_context - 1;     /* at least one token of room to generate */
    if (s->max_prompt_tokens > 0 && s->max_prompt_tokens < limit)
        limit = s->max_prompt_tokens;
    return limit;
}

int dsv4_settings_validate(const struct dsv4_settings *s)
{
    if (s->model[0] == '\0')
        return dsv4_error_set(-EINVAL, "no model: set model = DIR in the config file or pass --model DIR");
    if (s->max_prompt_tokens >= s->max_context)
        return dsv4_error_set(-EINVAL, "max_prompt_tokens = %d leaves no room to generate in max_context = %d",
                              s->max_prompt_tokens, s->max_context);
    /* The engine's request records: the queue, a running request and a finishing one a slot
     * (daemon/host.c sizes the scheduler so). */
    if ((int64_t)s->max_queued + 2 * (int64_t)s->max_batch > DSV4_SCHED_REQUESTS_MAX)
        return dsv4_error_set(-EINVAL, "max_queued = %d with max_batch = %d: the engine holds at most %d requests, "
                              "max_queued + 2 x max_batch", s->max_queued, s->max_batch, DSV4_SCHED_REQUESTS_MAX);
    if (s->expert_host_share > 0 && s->expert_offload != DSV4_EXPERT_OFFLOAD_ON)
        return dsv4_error_set(-EINVAL, "expert_host_share = %d needs expert_offload = on", s->expert_host_share);
    /* The slots are dealt out over the listed GPUs, each holding a group of them (doc/MULTIGPU.md);
     * refused here rather than by the CUDA backend once the weights have loaded. */
    if (s->n_gpus > s->max_batch) {
        char list[DSV4_SETTINGS_GPUS_TEXT_MAX];
        dsv4_settings_gpus_text(s->gpus, s->n_gpus, list);
        return dsv4_error_set(-EINVAL, "max_batch = %d with gpus = %s: each listed GPU holds a group of the slots, "
                              "so max_batch must be at least %d", s->max_batch, list, s->n_gpus);
    }
    return 0;
}

void dsv4_settings_gpus_text(const int *gpus, int n, char out[DSV4_SETTINGS_GPUS_TEXT_MAX])
{
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < n && i < DSV4_EP_MAX_GPUS; i++) {
        const int w = snprintf(out + len, DSV4_SETTINGS_GPUS_TEXT_MAX - len, "%s%d", i ? "," : "", gpus[i]);
        if (w < 0 || (size_t)w >= DSV4_SETTINGS_GPUS_TEXT_MAX - len)
            break;      /* an ordinal past DSV4_SETTINGS_GPU_ORDINAL_MAX: parse_gpus refuses those */
        len += (size_t)w;
    }
}

static void print_ids(FILE *f, const char *key, const uint32_t *ids, int n)
{
    fprintf(f, "%s =", key);
    for (int i = 0; i < n; i++)
        fprintf(f, "%s%" PRIu32, i ? "," : " ", ids[i]);
    fputc('\n', f);
}

void dsv4_settings_print(const struct dsv4_settings *s, FILE *f)
{
    static const char *const levels[] = { "emerg", "alert", "crit", "err", "warning", "notice", "info", "debug" };
    for (size_t i = 0; i < N_OPTS; i++) {
        const struct opt *o = &opts[i];
        const char *field = (const char *)s + o->offset;
        switch (o->type) {
        case OPT_PATH: fprintf(f, "%s = %s\n", o->key, field); break;
        case OPT_INT: fprintf(f, "%s = %d\n", o->key, *(const int *)field); break;
        case OPT_SIZE: fprintf(f, "%s = %" PRIu64 "\n", o->key, *(const uint64_t *)field); break;
        case OPT_SECONDS: fprintf(f, "%s = %g\n", o->key, *(const double *)field); break;
        case OPT_BACKEND: fprintf(f, "%s = %s\n", o->key, dsv4_settings_backend_name(s->backend)); break;
        case OPT_NUMERICS: fprintf(f, "%s = %s\n", o->key, numerics_name(s->numerics)); break;
        case OPT_OFFLOAD: fprintf(f, "%s = %s\n", o->key, offload_name(s->expert_offload)); break;
        case OPT_LEVEL: fprintf(f, "%s = %s\n", o->key, levels[s->log_level & 7]); break;
        case OPT_GPUS:
            if (s->n_gpus == 0)
                fprintf(f, "%s = all\n", o->key);
            else
                print_ids(f, o->key, (const uint32_t *)s->gpus, s->n_gpus);
            break;
        case OPT_USERS: print_ids(f, o->key, (const uint32_t *)s->allow_users, s->n_allow_users); break;
        case OPT_GROUPS: print_ids(f, o->key, (const uint32_t *)s->allow_groups, s->n_allow_groups); break;
        }
    }
}

void dsv4_settings_usage(FILE *f, const char *default_path)
{
    fprintf(f, "usage: dsv4d [--config FILE] [--model DIR] [--backend cpu|cuda|auto] [--listen PATH] [OPTION...]\n\n"
               "  %-32s settings file, key = value (default %s; \"\" for none)\n"
               "  %-32s print the effective settings and exit\n"
               "  %-32s this text, the version\n", "--config FILE", default_path ? default_path : "none",
               "--print-config", "--help, --version");
    for (size_t i = 0; i < N_OPTS; i++) {
        char flag[64];
        snprintf(flag, sizeof(flag), "--%s %s", opts[i].key, opts[i].arg);
        for (char *p = flag + 2; *p && *p != ' '; p++)
            if (*p == '_')
                *p = '-';
        fprintf(f, "  %-32s %s\n", flag, opts[i].help);
    }
    fputs("\nEvery option is also a config file key (max-batch <=> max_batch). Without --listen, the\n"
          "listening socket comes from systemd socket activation.\n", f);
}
