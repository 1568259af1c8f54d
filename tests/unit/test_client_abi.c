/* SPDX-License-Identifier: MIT */
/* libdsv4client's ABI (client/dsv4client.h, DSV4_CLIENT_ABI): the layout of every struct the header
 * defines is recorded here per ABI for LP64 targets, as each struct's size and a fingerprint of its
 * fields' offsets and sizes in order. A layout that changes without a new DSV4_CLIENT_ABI fails, and
 * so does a header whose DSV4_CLIENT_ABI is not the soname version the build gives the library. */
#include "build-config.h"

#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "client/dsv4client.h"

/* Every field of each struct, in declaration order. A field added to the header and not here still
 * fails: the struct's size changes. */
#define FIELDS_INFO(F) F(protocol) F(server) F(model_name) F(vocab_size) F(hidden_size) F(num_layers) \
    F(num_heads) F(head_dim) F(n_routed_experts) F(experts_per_token) F(bos_id) F(eos_id) F(max_context) \
    F(max_batch) F(backend) F(max_frame) F(max_prompt_tokens) F(max_tokens) F(max_connections) F(max_queue) \
    F(max_requests_per_connection)
#define FIELDS_MESSAGE(F) F(role) F(content)
#define FIELDS_GENERATE_PARAMS(F) F(prompt) F(add_bos) F(messages) F(n_messages) F(thinking) F(tokens) \
    F(n_tokens) F(prompt_parts) F(prompt_part_lens) F(n_prompt_parts) F(max_tokens) F(temperature) F(top_p) \
    F(top_k) F(min_p) F(presence_penalty) F(frequency_penalty) F(repetition_penalty) F(has_seed) F(seed) \
    F(stop) F(n_stop) F(stop_token_ids) F(n_stop_token_ids) F(logprobs)
#define FIELDS_LOGPROB(F) F(logprob) F(n_top) F(top_ids) F(top_logprobs)
#define FIELDS_RESULT(F) F(text) F(text_len) F(tokens) F(n_tokens) F(finish_reason) F(error_message) \
    F(prompt_tokens) F(completion_tokens) F(queue_ms) F(prefill_ms) F(decode_ms) F(total_ms) F(logprobs) \
    F(decode_tokens_per_s) F(cached_tokens)
#define FIELDS_TOKEN(F) F(id) F(text) F(text_len) F(logprob)
#define FIELDS_STATS(F) F(uptime_s) F(backend) F(slots_total) F(slots_busy) F(queue_depth) F(connections) \
    F(requests_total) F(requests_failed) F(requests_cancelled) F(prompt_tokens_total) \
    F(generated_tokens_total) F(prefill_tokens_per_s) F(decode_tokens_per_s) F(prefill_tokens_total) \
    F(prefill_chunks_total) F(device_arena_bytes) F(device_arena_used) F(heap_allocated) F(heap_active) \
    F(heap_resident) F(heap_mapped) F(device_allocs_after_boot) F(graph_captures_after_boot) F(eager_steps) \
    F(n_kernels) F(kernels) F(steps) F(decode_steps) F(n_batch_hist) F(batch_hist) F(sched_allocations) \
    F(sched_allocations_after_boot) F(prefix_cache_bytes) F(prefix_cache_used_bytes) F(prefix_cache_tokens) \
    F(prefix_cache_snapshots) F(prefix_cache_lookups) F(prefix_cache_hits) F(prefix_cache_hit_tokens) \
    F(prefix_cache_evictions) F(spec_tokens) F(spec_verifies) F(spec_drafted) F(spec_accepted) \
    F(n_spec_hist) F(spec_hist) F(engine_busy_s) F(engine_backend_s) F(engine_gap_s) F(present) \
    F(n_latency_bounds) F(latency_bounds_s) F(queue) F(ttft) F(tpot) F(e2e)
#define FIELDS_LATENCY(F) F(n_buckets) F(buckets) F(count) F(sum_s)
#define FIELDS_HEALTH(F) F(status) F(reason)

struct layout {
    int abi;
    const char *name;
    size_t size;
    uint64_t fingerprint;
};

/* The layouts each ABI was released with. A new ABI adds its rows; old rows stay as its record. */
static const struct layout recorded[] = {
    /* ABI 1: the first with recorded layouts */
    { 1, "info", 104, 0xc669c0f610d1dc7dull },
    { 1, "message", 16, 0xc1a4e45df7abd7adull },
    { 1, "generate_params", 168, 0x5cdc98a0c237e2a8ull },
    { 1, "logprob", 176, 0xf461ea0284fe7951ull },
    { 1, "result", 112, 0xdad9166646980c51ull },
    { 1, "token", 32, 0xbd4adcc1d921f3a9ull },
    { 1, "stats", 17248, 0xd491506abac59ed6ull },
    { 1, "health", 260, 0xe889471f5263da4aull },
    /* ABI 2: the latency histograms appended to stats (struct dsv4_client_latency) */
    { 2, "info", 104, 0xc669c0f610d1dc7dull },
    { 2, "message", 16, 0xc1a4e45df7abd7adull },
    { 2, "generate_params", 168, 0x5cdc98a0c237e2a8ull },
    { 2, "logprob", 176, 0xf461ea0284fe7951ull },
    { 2, "result", 112, 0xdad9166646980c51ull },
    { 2, "token", 32, 0xbd4adcc1d921f3a9ull },
    { 2, "stats", 19904, 0x2a2be756538f4b49ull },
    { 2, "health", 260, 0xe889471f5263da4aull },
    { 2, "latency", 536, 0x6c56746fc7ca19c7ull },
};

static uint64_t fold(uint64_t h, size_t v)
{
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= 0x100000001b3ull;     /* FNV-1a */
    }
    return h;
}

#define FOLD_FIELD(f) h = fold(fold(h, offsetof(T, f)), sizeof(((T *)0)->f));
#define MEASURE(short_name, fields)                                                            \
    do {                                                                                       \
        uint64_t h = 0xcbf29ce484222325ull;                                                    \
        fields(FOLD_FIELD)                                                                     \
        check(short_name, sizeof(T), h);                                                       \
    } while (0)

static void check(const char *name, size_t size, uint64_t fingerprint)
{
    for (size_t i = 0; i < sizeof(recorded) / sizeof(recorded[0]); i++) {
        const struct layout *r = &recorded[i];
        if (r->abi != DSV4_CLIENT_ABI || strcmp(r->name, name))
            continue;
        if (r->size != size || r->fingerprint != fingerprint)
            fail_msg("struct dsv4_client_%s: size %zu, fingerprint 0x%016llx; ABI %d has size %zu, fingerprint "
                     "0x%016llx. A changed layout is a new ABI: raise DSV4_CLIENT_ABI in client/dsv4client.h and "
                     "dsv4client_abi in configure.ac together, and record its rows here", name, size,
                     (unsigned long long)fingerprint, DSV4_CLIENT_ABI, r->size, (unsigned long long)r->fingerprint);
        return;
    }
    fail_msg("struct dsv4_client_%s has no layout recorded for ABI %d: { %d, \"%s\", %zu, 0x%016llxull },", name,
             DSV4_CLIENT_ABI, DSV4_CLIENT_ABI, name, size, (unsigned long long)fingerprint);
}

static void test_layouts(void **state)
{
    (void)state;
    if (sizeof(void *) != 8 || sizeof(long) != 8 || sizeof(int) != 4)
        skip();     /* the recorded layouts are LP64's */
#define T struct dsv4_client_info
    MEASURE("info", FIELDS_INFO);
#undef T
#define T struct dsv4_client_message
    MEASURE("message", FIELDS_MESSAGE);
#undef T
#define T struct dsv4_client_generate_params
    MEASURE("generate_params", FIELDS_GENERATE_PARAMS);
#undef T
#define T struct dsv4_client_logprob
    MEASURE("logprob", FIELDS_LOGPROB);
#undef T
#define T struct dsv4_client_result
    MEASURE("result", FIELDS_RESULT);
#undef T
#define T struct dsv4_client_token
    MEASURE("token", FIELDS_TOKEN);
#undef T
#define T struct dsv4_client_stats
    MEASURE("stats", FIELDS_STATS);
#undef T
#define T struct dsv4_client_health
    MEASURE("health", FIELDS_HEALTH);
#undef T
#define T struct dsv4_client_latency
    MEASURE("latency", FIELDS_LATENCY);
#undef T
}

/* The header's ABI is the one the build links into the soname, libdsv4client.so.N. */
static void test_soname(void **state)
{
    (void)state;
    assert_int_equal(DSV4_CLIENT_ABI, DSV4CLIENT_ABI_BUILT);
    const char *top = getenv("top_builddir");
    char lib[PATH_MAX], versioned[PATH_MAX + 16];
    if (snprintf(lib, sizeof(lib), "%s/.libs/libdsv4client.so", top ? top : ".") >= (int)sizeof(lib))
        fail_msg("top_builddir is too long");
    snprintf(versioned, sizeof(versioned), "%s.%d", lib, DSV4_CLIENT_ABI);
    if (access(lib, F_OK) != 0)
        skip();     /* built without shared libraries */
    if (access(versioned, F_OK) != 0)
        fail_msg("%s exists but %s does not: the soname is not DSV4_CLIENT_ABI", lib, versioned);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layouts),
        cmocka_unit_test(test_soname),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
