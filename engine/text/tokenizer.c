/* SPDX-License-Identifier: MIT */
/* engine/text/tokenizer: byte-level BPE identical to Hugging Face `tokenizers` (see tokenizer.h for the
 * file subset it accepts and the encoding pipeline). */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <oniguruma.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/utf8.h"
#include "engine/error.h"
#include "engine/text/tokenizer.h"
#include "engine/text/tok_internal.h"

/* Split regexes a pre-tokenizer Sequence may hold. */
#define TOK_MAX_REGEXES 16
/* Words up to this many bytes are cached (longer ones are rare and cheap relative to their size). */
#define TOK_CACHE_WORD_MAX 24
/* Direct-mapped cache slots (power of two) and the lock stripes guarding them. */
#define TOK_CACHE_SLOTS 65536
#define TOK_CACHE_LOCKS 64
/* BPE on words up to this many symbols uses stack buffers. */
#define TOK_WORD_STACK 128

struct tok_cache_slot {
    uint64_t hash;
    uint8_t len;   /* word bytes; 0 = empty slot */
    uint8_t nids;
    char word[TOK_CACHE_WORD_MAX];
    int32_t ids[TOK_CACHE_WORD_MAX];
};

/* The word cache is the only state encoding writes; it lives apart from the (read-only)
 * tokenizer. Slot i is guarded by lock[i % TOK_CACHE_LOCKS]. */
struct tok_cache {
    pthread_mutex_t lock[TOK_CACHE_LOCKS];
    struct tok_cache_slot slot[TOK_CACHE_SLOTS];
};

/* Added-token trie over bytes: edges live in one open-addressed table keyed by (node, byte). */
struct tok_trie {
    uint32_t nnodes;
    int32_t *term;        /* [nnodes] index into tok->added, or -1 */
    uint64_t *edge_key;   /* [edge_cap] (node + 1) << 8 | byte; 0 = empty */
    uint32_t *edge_child; /* [edge_cap] */
    size_t edge_cap;
    uint8_t first[32];    /* bitmap of bytes that start some token */
};

struct tok_added {
    int32_t id;
    bool special;
    bool normalized;
    char *content;
};

struct tok_merge_slot {
    uint64_t key;         /* (left << 32 | right) + 1; 0 = empty */
    uint32_t rank;
    int32_t new_id;
};

struct dsv4_tokenizer {
    size_t nids;                 /* vocab_size: 1 + largest id */
    char **str;                  /* [nids] token string (vocab form or added content) or NULL */
    uint32_t *bytes_off;         /* [nids + 1] offsets into bytes (decoded form of each id) */
    char *bytes;
    uint8_t *flags;              /* [nids] TOK_ID_* */
    /* token string -> id */
    int32_t *str_table;          /* [str_cap] id or -1 */
    size_t str_cap;
    int32_t byte_id[256];        /* id of the single byte-level symbol of each byte */
    struct tok_merge_slot *merges;
    size_t merge_cap;            /* 1 << merge_bits */
    unsigned merge_bits;
    struct tok_added *added;
    size_t nadded;
    struct tok_trie trie_raw;    /* added tokens with normalized=false, matched first */
    struct tok_trie trie_norm;   /* normalized=true, matched in what is left */
    OnigRegex regex[TOK_MAX_REGEXES];
    size_t nregex;
    struct tok_cache *cache;
};

enum {
    TOK_ID_ADDED = 1u << 0,
    TOK_ID_SPECIAL = 1u << 1,
};

/* ---- hashing ---- */

static uint64_t mix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t dsv4_tok_hash_bytes(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0x100000001b3ULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x87c37b91114253d5ULL;
        h = (h << 31) | (h >> 33);
        p += 8;
        n -= 8;
    }
    uint64_t t = 0;
    memcpy(&t, p, n);
    h ^= t;
    return mix64(h);
}

/* ---- byte-level alphabet (GPT-2): printable Latin-1 bytes map to themselves, the rest to
 * U+0100.. in byte order ---- */

static bool byte_is_printable(int b)
{
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

void dsv4_tok_byte_to_codepoints(uint32_t cp[256])
{
    uint32_t n = 0;
    for (int b = 0; b < 256; b++)
        cp[b] = byte_is_printable(b) ? (uint32_t)b : 256 + n++;
}

/* ---- UTF-8 repair (base/utf8.h scans) ---- */

char *dsv4_utf8_lossy(const char *bytes, size_t len, size_t *ret_len)
{
    /* Each invalid byte becomes at most 3 bytes. */
    char *out = malloc(len * 3 + 1);
    if (!out)
        return NULL;
    const unsigned char *p = (const unsigned char *)bytes;
    size_t i = 0, o = 0;
    while (i < len) {
        size_t used;
        enum dsv4_utf8_step st = dsv4_utf8_step(p + i, len - i, &used);
        if (st == DSV4_UTF8_VALID) {
            memcpy(out + o, p + i, used);
            o += used;
        } else {
            memcpy(out + o, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
            o += 3;
        }
        i += used;
    }
    out[o] = '\0';
    if (ret_len)
        *ret_len = o;
    return out;
}

/* ---- id arrays ---- */

void dsv4_tok_ids_free(struct dsv4_tok_ids *ids)
{
    if (!ids)
        return;
    free(ids->ids);
    ids->ids = NULL;
    ids->len = ids->cap = 0;
}

static int ids_reserve(struct dsv4_tok_ids *ids, size_t extra)
{
    if (ids->len + extra <= ids->cap)
        return 0;
    size_t cap = ids->cap ? ids->cap : 64;
    while (cap < ids->len + extra)
        cap *= 2;
    int32_t *n = realloc(ids->ids, cap * sizeof(*n));
    if (!n)
        return dsv4_error_set(-ENOMEM, "tokenizer: out of memory growing an id array to %zu ids", cap);
    ids->ids = n;
    ids->cap = cap;
    return 0;
}

int dsv4_tok_ids_push(struct dsv4_tok_ids *ids, int32_t id)
{
    int r = ids_reserve(ids, 1);
    if (r)
        return r;
    ids->ids[ids->len++] = id;
    return 0;
}

/* ---- token string table ---- */

static int32_t str_lookup(const struct dsv4_tokenizer *tok, const char *s, size_t n)
{
    size_t mask = tok->str_cap - 1;
    for (size_t i = dsv4_tok_hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = tok->str_table[i];
        if (id < 0)
            return -1;
        const char *t = tok->str[id];
        if (strlen(t) == n && !memcmp(t, s, n))
            return id;
    }
}

static void str_insert(struct dsv4_tokenizer *tok, int32_t id)
{
    const char *s = tok->str[id];
    size_t mask = tok->str_cap - 1;
    size_t i = dsv4_tok_hash_bytes(s, strlen(s)) & mask;
    while (tok->str_table[i] >= 0) {
        if (!strcmp(tok->str[tok->str_table[i]], s))
            return;  /* an added token repeating a vocab entry keeps the first id (same string) */
        i = (i + 1) & mask;
    }
    tok->str_table[i] = id;
}

/* ---- merges ---- */

static uint64_t merge_key(int32_t left, int32_t right)
{
    return (((uint64_t)(uint32_t)left << 32) | (uint32_t)right) + 1;
}

/* Slot of a merge key: one multiply, top bits (the table is a power of two of at least 16). */
static size_t merge_slot(const struct dsv4_tokenizer *tok, uint64_t key)
{
    return (size_t)((key * 0x9e3779b97f4a7c15ULL) >> (64 - tok->merge_bits));
}

static const struct tok_merge_slot *merge_find(const struct dsv4_tokenizer *tok, int32_t left,
                                               int32_t right)
{
    uint64_t key = merge_key(left, right);
    size_t mask = tok->merge_cap - 1;
    for (size_t i = merge_slot(tok, key);; i = (i + 1) & mask) {
        const struct tok_merge_slot *s = &tok->merges[i];
        if (s->key == key)
            return s;
        if (!s->key)
            return NULL;
    }
}

/* ---- tries ---- */

static int trie_init(struct tok_trie *t, size_t max_edges)
{
    t->edge_cap = 16;
    while (t->edge_cap < 2 * max_edges + 2)
        t->edge_cap *= 2;
    t->edge_key = calloc(t->edge_cap, sizeof(*t->edge_key));
    t->edge_child = calloc(t->edge_cap, sizeof(*t->edge_child));
    t->term = malloc((max_edges + 1) * sizeof(*t->term));
    if (!t->edge_key || !t->edge_child || !t->term)
        return -ENOMEM;
    t->nnodes = 1;
    t->term[0] = -1;
    return 0;
}

static void trie_free(struct tok_trie *t)
{
    free(t->edge_key);
    free(t->edge_child);
    free(t->term);
}

static int64_t trie_child(const struct tok_trie *t, uint32_t node, unsigned char c)
{
    uint64_t key = ((uint64_t)(node + 1) << 8) | c;
    size_t mask = t->edge_cap - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (t->edge_key[i] == key)
            return t->edge_child[i];
        if (!t->edge_key[i])
            return -1;
    }
}

/* The caller sized the trie for the sum of all content lengths. */
static void trie_add(struct tok_trie *t, const char *s, int32_t index)
{
    uint32_t node = 0;
    t->first[(unsigned char)s[0] >> 3] |= (uint8_t)(1u << ((unsigned char)s[0] & 7));
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        int64_t c = trie_child(t, node, *p);
        if (c < 0) {
            uint64_t key = ((uint64_t)(node + 1) << 8) | *p;
            size_t mask = t->edge_cap - 1, i = mix64(key) & mask;
            while (t->edge_key[i])
                i = (i + 1) & mask;
            t->edge_key[i] = key;
            t->edge_child[i] = t->nnodes;
            t->term[t->nnodes] = -1;
            c = t->nnodes++;
        }
        node = (uint32_t)c;
    }
    /* A content listed twice keeps its first entry, as the Rust library's map does. */
    if (t->term[node] < 0)
        t->term[node] = index;
}

/* Leftmost-longest match at or after `from`: returns the start (or len when none), the end in
 * *ret_end and the added-token index in *ret_index. */
static size_t trie_find(const struct tok_trie *t, const unsigned char *s, size_t len, size_t from,
                        size_t *ret_end, int32_t *ret_index)
{
    if (t->nnodes <= 1)
        return len;
    for (size_t i = from; i < len; i++) {
        if (!(t->first[s[i] >> 3] & (1u << (s[i] & 7))))
            continue;
        uint32_t node = 0;
        size_t best = 0;
        int32_t best_index = -1;
        for (size_t j = i; j < len; j++) {
            int64_t c = trie_child(t, node, s[j]);
            if (c < 0)
                break;
            node = (uint32_t)c;
            if (t->term[node] >= 0) {
                best = j + 1;
                best_index = t->term[node];
            }
        }
        if (best_index >= 0) {
            *ret_end = best;
            *ret_index = best_index;
            return i;
        }
    }
    return len;
}

/* ---- loading ---- */

static pthread_once_t onig_once = PTHREAD_ONCE_INIT;

static void onig_setup(void)
{
    OnigEncoding enc[1] = {ONIG_ENCODING_UTF8};
    onig_initialize(enc, 1);
}

void dsv4_tokenizer_free(struct dsv4_tokenizer *tok)
{
    if (!tok)
        return;
    if (tok->str)
        for (size_t i = 0; i < tok->nids; i++)
            free(tok->str[i]);
    free(tok->str);
    free(tok->bytes_off);
    free(tok->bytes);
    free(tok->flags);
    free(tok->str_table);
    free(tok->merges);
    for (size_t i = 0; i < tok->nadded; i++)
        free(tok->added[i].content);
    free(tok->added);
    trie_free(&tok->trie_raw);
    trie_free(&tok->trie_norm);
    for (size_t i = 0; i < tok->nregex; i++)
        onig_free(tok->regex[i]);
    if (tok->cache) {
        for (size_t i = 0; i < TOK_CACHE_LOCKS; i++)
            pthread_mutex_destroy(&tok->cache->lock[i]);
        free(tok->cache);
    }
    free(tok);
}

/* A JSON member that must be absent, null, or equal to the given boolean. */
static bool json_is_flag(const json_t *obj, const char *key, bool want)
{
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v))
        return true;
    return json_is_boolean(v) && json_boolean_value(v) == want;
}

static bool json_null_or_empty(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    return !v || json_is_null(v) || (json_is_string(v) && !json_string_length(v));
}

static const char *json_type_name(const json_t *obj)
{
    const json_t *t = json_object_get(obj, "type");
    return json_is_string(t) ? json_string_value(t) : "(no type)";
}

static int check_parts(const json_t *root)
{
    const json_t *v = json_object_get(root, "normalizer");
    if (v && !json_is_null(v)) {
        const json_t *list = json_object_get(v, "normalizers");
        if (strcmp(json_type_name(v), "Sequence") || !json_is_array(list) || json_array_size(list))
            return dsv4_error_set(-ENOTSUP, "normalizer %s is not supported (only none or an empty "
                                  "Sequence)", json_type_name(v));
    }
    v = json_object_get(root, "decoder");
    if (!v || strcmp(json_type_name(v), "ByteLevel"))
        return dsv4_error_set(-ENOTSUP, "decoder %s is not supported (only ByteLevel)",
                              v ? json_type_name(v) : "null");
    v = json_object_get(root, "post_processor");
    if (v && !json_is_null(v) && strcmp(json_type_name(v), "ByteLevel"))
        return dsv4_error_set(-ENOTSUP, "post_processor %s is not supported (only none or ByteLevel, "
                              "which adds no tokens)", json_type_name(v));
    if (!json_is_flag(root, "truncation", false) || !json_is_flag(root, "padding", false))
        return dsv4_error_set(-ENOTSUP, "truncation/padding settings are not supported (must be null)");
    const json_t *m = json_object_get(root, "model");
    if (!json_is_object(m))
        return dsv4_error_set(-EINVAL, "no \"model\" object");
    if (json_object_get(m, "type") && strcmp(json_type_name(m), "BPE"))
        return dsv4_error_set(-ENOTSUP, "model type %s is not supported (only BPE)", json_type_name(m));
    const json_t *dropout = json_object_get(m, "dropout");
    if (dropout && !json_is_null(dropout))
        return dsv4_error_set(-ENOTSUP, "model.dropout is not supported (must be null)");
    if (!json_is_flag(m, "byte_fallback", false))
        return dsv4_error_set(-ENOTSUP, "model.byte_fallback true is not supported");
    if (!json_is_flag(m, "ignore_merges", false))
        return dsv4_error_set(-ENOTSUP, "model.ignore_merges true is not supported");
    if (!json_null_or_empty(m, "continuing_subword_prefix"))
        return dsv4_error_set(-ENOTSUP, "model.continuing_subword_prefix is not supported");
    if (!json_null_or_empty(m, "end_of_word_suffix"))
        return dsv4_error_set(-ENOTSUP, "model.end_of_word_suffix is not supported");
    return 0;
}

struct tok_buf {
    char *data;
    size_t len, cap;
};

static int buf_put(struct tok_buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return -ENOMEM;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

static int buf_put_ranges(struct tok_buf *b, const struct dsv4_tok_unicode_class *c)
{
    int r = 0;
    for (size_t i = 0; i < c->n && !r; i++) {
        char item[40];
        int n = c->ranges[i][0] == c->ranges[i][1]
                    ? snprintf(item, sizeof(item), "\\x{%x}", c->ranges[i][0])
                    : snprintf(item, sizeof(item), "\\x{%x}-\\x{%x}", c->ranges[i][0], c->ranges[i][1]);
        r = buf_put(b, item, (size_t)n);
    }
    return r;
}

/* Copy a split regex with every \p{L}, \p{N}, \p{P}, \p{S}, \p{M} replaced by the explicit
 * ranges `tokenizers` has for them (see tok_internal.h): inside a bracket class the ranges go in
 * place, outside they become a bracket class of their own. Other syntax is copied unchanged. */
static int rewrite_pattern(const char *pat, size_t len, struct tok_buf *out)
{
    int depth = 0, r = 0;
    for (size_t i = 0; i < len && !r;) {
        char c = pat[i];
        if (c == '\\' && i + 4 < len && pat[i + 1] == 'p' && pat[i + 2] == '{' && pat[i + 4] == '}') {
            const struct dsv4_tok_unicode_class *k = dsv4_tok_unicode_classes;
            while (k->name && (k->name[0] != pat[i + 3] || k->name[1]))
                k++;
            if (k->name) {
                if (!depth)
                    r = buf_put(out, "[", 1);
                if (!r)
                    r = buf_put_ranges(out, k);
                if (!r && !depth)
                    r = buf_put(out, "]", 1);
                i += 5;
                continue;
            }
        }
        if (c == '\\') {
            r = buf_put(out, pat + i, i + 1 < len ? 2 : 1);
            i += 2;
            continue;
        }
        if (c == '[')
            depth++;
        else if (c == ']' && depth)
            depth--;
        r = buf_put(out, &c, 1);
        i++;
    }
    return r;
}

static int load_pre_tokenizer(struct dsv4_tokenizer *tok, const json_t *root)
{
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    const json_t *list = json_object_get(pre, "pretokenizers");
    if (!pre || strcmp(json_type_name(pre), "Sequence") || !json_is_array(list))
        return dsv4_error_set(-ENOTSUP, "pre_tokenizer %s is not supported (only a Sequence of Split "
                              "regexes ending in ByteLevel)", pre ? json_type_name(pre) : "null");
    size_t n = json_array_size(list);
    for (size_t i = 0; i < n; i++) {
        const json_t *p = json_array_get(list, i);
        const char *type = json_type_name(p);
        if (!strcmp(type, "ByteLevel")) {
            if (i + 1 != n)
                return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: ByteLevel must come last", i);
            if (!json_is_flag(p, "add_prefix_space", false) || !json_is_flag(p, "use_regex", false))
                return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: ByteLevel with add_prefix_space or "
                                      "use_regex true is not supported", i);
            return 0;
        }
        if (strcmp(type, "Split"))
            return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: type %s is not supported", i, type);
        const json_t *behavior = json_object_get(p, "behavior");
        const json_t *re = json_object_get(json_object_get(p, "pattern"), "Regex");
        if (!json_is_string(re))
            return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: only Regex split patterns are supported", i);
        if (!json_is_string(behavior) || strcmp(json_string_value(behavior), "Isolated"))
            return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: split behavior other than Isolated is "
                                  "not supported", i);
        if (!json_is_flag(p, "invert", false))
            return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: invert true is not supported", i);
        if (tok->nregex == TOK_MAX_REGEXES)
            return dsv4_error_set(-E2BIG, "pre_tokenizer: more than %d Split regexes", TOK_MAX_REGEXES);
        struct tok_buf pat = {0};
        if (rewrite_pattern(json_string_value(re), json_string_length(re), &pat) || !pat.data) {
            free(pat.data);
            return dsv4_error_set(-ENOMEM, "pre_tokenizer %zu: out of memory", i);
        }
        OnigErrorInfo einfo;
        int r = onig_new(&tok->regex[tok->nregex], (const UChar *)pat.data, (const UChar *)pat.data + pat.len,
                         ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_RUBY, &einfo);
        free(pat.data);
        if (r != ONIG_NORMAL) {
            UChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
            onig_error_code_to_str(msg, r, &einfo);
            return dsv4_error_set(-EINVAL, "pre_tokenizer %zu: regex does not compile: %s", i, (char *)msg);
        }
        tok->nregex++;
        /* An empty match would need the Rust crate's skip-ahead rule; refuse such patterns. */
        OnigRegion *region = onig_region_new();
        const UChar empty[1] = {0};
        r = onig_search(tok->regex[tok->nregex - 1], empty, empty, empty, empty, region, ONIG_OPTION_NONE);
        onig_region_free(region, 1);
        if (r >= 0)
            return dsv4_error_set(-ENOTSUP, "pre_tokenizer %zu: regex matches empty text; not supported", i);
    }
    return dsv4_error_set(-ENOTSUP, "pre_tokenizer: no ByteLevel step at the end");
}

static int load_vocab(struct dsv4_tokenizer *tok, const json_t *vocab, const json_t *added)
{
    if (!json_is_object(vocab))
        return dsv4_error_set(-EINVAL, "model.vocab is not an object");
    if (!json_is_array(added))
        return dsv4_error_set(-EINVAL, "added_tokens is not an array");
    int64_t max_id = -1;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)vocab, key, val) {
        json_int_t id = json_integer_value(val);
        if (!json_is_integer(val) || id < 0 || id >= DSV4_TOK_MAX_VOCAB)
            return dsv4_error_set(-EINVAL, "model.vocab[\"%s\"]: id must be an integer in [0, %d)", key,
                                  DSV4_TOK_MAX_VOCAB);
        if (id > max_id)
            max_id = id;
    }
    size_t i;
    json_array_foreach(added, i, val) {
        const json_t *id = json_object_get(val, "id");
        const json_t *content = json_object_get(val, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= DSV4_TOK_MAX_VOCAB)
            return dsv4_error_set(-EINVAL, "added_tokens[%zu]: id must be an integer in [0, %d)", i,
                                  DSV4_TOK_MAX_VOCAB);
        if (!json_is_string(content) || !json_string_length(content) ||
            json_string_length(content) > DSV4_TOK_MAX_TOKEN_BYTES)
            return dsv4_error_set(-EINVAL, "added_tokens[%zu]: content must be a string of 1..%d bytes", i,
                                  DSV4_TOK_MAX_TOKEN_BYTES);
        static const char *const unsupported[] = {"lstrip", "rstrip", "single_word"};
        for (size_t k = 0; k < 3; k++)
            if (!json_is_flag(val, unsupported[k], false))
                return dsv4_error_set(-ENOTSUP, "added_tokens[%zu] (\"%s\"): %s true is not supported", i,
                                      json_string_value(content), unsupported[k]);
        if (json_integer_value(id) > max_id)
            max_id = json_integer_value(id);
    }
    if (max_id < 0)
        return dsv4_error_set(-EINVAL, "empty vocabulary");
    tok->nids = (size_t)max_id + 1;
    tok->str = calloc(tok->nids, sizeof(*tok->str));
    tok->flags = calloc(tok->nids, 1);
    tok->nadded = json_array_size(added);
    tok->added = calloc(tok->nadded ? tok->nadded : 1, sizeof(*tok->added));
    if (!tok->str || !tok->flags || !tok->added)
        return dsv4_error_set(-ENOMEM, "out of memory for %zu token ids", tok->nids);
    json_object_foreach((json_t *)vocab, key, val) {
        size_t id = (size_t)json_integer_value(val);
        size_t len = strlen(key);
        if (!len || len > DSV4_TOK_MAX_TOKEN_BYTES)
            return dsv4_error_set(-EINVAL, "model.vocab entry %zu: length %zu outside 1..%d bytes", id, len,
                                  DSV4_TOK_MAX_TOKEN_BYTES);
        if (tok->str[id])
            return dsv4_error_set(-EINVAL, "model.vocab: id %zu given to both \"%s\" and \"%s\"", id,
                                  tok->str[id], key);
        if (!(tok->str[id] = strdup(key)))
            return dsv4_error_set(-ENOMEM, "out of memory loading the vocabulary");
    }
    json_array_foreach(added, i, val) {
        struct tok_added *a = &tok->added[i];
        a->id = (int32_t)json_integer_value(json_object_get(val, "id"));
        a->special = json_is_true(json_object_get(val, "special"));
        a->normalized = json_is_true(json_object_get(val, "normalized"));
        if (!(a->content = strdup(json_string_value(json_object_get(val, "content")))))
            return dsv4_error_set(-ENOMEM, "out of memory loading added tokens");
        /* The added vocabulary wins over the model's entry for the same id, as in the library. */
        free(tok->str[a->id]);
        if (!(tok->str[a->id] = strdup(a->content)))
            return dsv4_error_set(-ENOMEM, "out of memory loading added tokens");
        tok->flags[a->id] |= TOK_ID_ADDED | (a->special ? TOK_ID_SPECIAL : 0);
    }
    tok->str_cap = 16;
    while (tok->str_cap < 2 * tok->nids)
        tok->str_cap *= 2;
    if (!(tok->str_table = malloc(tok->str_cap * sizeof(*tok->str_table))))
        return dsv4_error_set(-ENOMEM, "out of memory for the token table");
    memset(tok->str_table, 0xff, tok->str_cap * sizeof(*tok->str_table));
    for (size_t a = 0; a < tok->nadded; a++)
        str_insert(tok, tok->added[a].id);
    for (size_t id = 0; id < tok->nids; id++)
        if (tok->str[id])
            str_insert(tok, (int32_t)id);
    return 0;
}

static int lookup_symbol(const struct dsv4_tokenizer *tok, const char *s, size_t n, size_t rank,
                         int32_t *ret_id)
{
    int32_t id = str_lookup(tok, s, n);
    if (id < 0)
        return dsv4_error_set(-EINVAL, "model.merges[%zu]: \"%.*s\" is not in the vocabulary", rank,
                              (int)n, s);
    *ret_id = id;
    return 0;
}

static int load_merges(struct dsv4_tokenizer *tok, const json_t *merges)
{
    if (!json_is_array(merges))
        return dsv4_error_set(-EINVAL, "model.merges is not an array");
    size_t n = json_array_size(merges);
    tok->merge_cap = 16;
    tok->merge_bits = 4;
    while (tok->merge_cap < 2 * n + 2) {
        tok->merge_cap *= 2;
        tok->merge_bits++;
    }
    if (!(tok->merges = calloc(tok->merge_cap, sizeof(*tok->merges))))
        return dsv4_error_set(-ENOMEM, "out of memory for %zu merges", n);
    char joined[2 * DSV4_TOK_MAX_TOKEN_BYTES + 1];
    for (size_t rank = 0; rank < n; rank++) {
        const json_t *m = json_array_get(merges, rank);
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(m)) {
            a = json_string_value(m);
            const char *sp = strchr(a, ' ');
            if (!sp || strchr(sp + 1, ' '))
                return dsv4_error_set(-EINVAL, "model.merges[%zu]: \"%s\" is not two symbols separated by "
                                      "one space", rank, a);
            alen = (size_t)(sp - a);
            b = sp + 1;
            blen = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            alen = strlen(a);
            blen = strlen(b);
        } else {
            return dsv4_error_set(-EINVAL, "model.merges[%zu]: neither \"a b\" nor [\"a\", \"b\"]", rank);
        }
        if (alen + blen > 2 * DSV4_TOK_MAX_TOKEN_BYTES)
            return dsv4_error_set(-EINVAL, "model.merges[%zu]: symbols too long", rank);
        int32_t left = -1, right = -1, merged = -1;
        memcpy(joined, a, alen);
        memcpy(joined + alen, b, blen);
        int r;
        if ((r = lookup_symbol(tok, a, alen, rank, &left)) || (r = lookup_symbol(tok, b, blen, rank, &right)) ||
            (r = lookup_symbol(tok, joined, alen + blen, rank, &merged)))
            return r;
        /* A pair listed twice takes its last rank, as the library's map does. */
        uint64_t key = merge_key(left, right);
        size_t mask = tok->merge_cap - 1, i = merge_slot(tok, key);
        while (tok->merges[i].key && tok->merges[i].key != key)
            i = (i + 1) & mask;
        tok->merges[i] = (struct tok_merge_slot){.key = key, .rank = (uint32_t)rank, .new_id = merged};
    }
    return 0;
}

/* Decoded bytes of every id: byte-level symbols back to bytes; a string with any character
 * outside the alphabet stays as its UTF-8 (the ByteLevel decoder's rule). */
static int build_bytes(struct dsv4_tokenizer *tok)
{
    uint32_t cp[256];
    int16_t back[512];
    dsv4_tok_byte_to_codepoints(cp);
    memset(back, 0xff, sizeof(back));
    for (int b = 0; b < 256; b++)
        back[cp[b]] = (int16_t)b;
    size_t total = 0;
    for (size_t id = 0; id < tok->nids; id++)
        total += tok->str[id] ? strlen(tok->str[id]) : 0;
    tok->bytes_off = malloc((tok->nids + 1) * sizeof(*tok->bytes_off));
    tok->bytes = malloc(total + 1);
    if (!tok->bytes_off || !tok->bytes)
        return dsv4_error_set(-ENOMEM, "out of memory for decoded token bytes");
    size_t o = 0;
    for (size_t id = 0; id < tok->nids; id++) {
        tok->bytes_off[id] = (uint32_t)o;
        const char *s = tok->str[id];
        if (!s)
            continue;
        size_t len = strlen(s), start = o;
        bool mapped = true;
        for (size_t i = 0; i < len;) {
            const unsigned char *p = (const unsigned char *)s + i;
            uint32_t c;
            size_t used;
            if (dsv4_utf8_step(p, len - i, &used) != DSV4_UTF8_VALID)
                return dsv4_error_set(-EINVAL, "token %zu is not valid UTF-8", id);
            if (used == 1)
                c = p[0];
            else if (used == 2)
                c = ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
            else
                c = 512;
            if (c >= 512 || back[c] < 0) {
                mapped = false;
                break;
            }
            tok->bytes[o++] = (char)back[c];
            i += used;
        }
        if (!mapped) {
            memcpy(tok->bytes + start, s, len);
            o = start + len;
        }
    }
    tok->bytes_off[tok->nids] = (uint32_t)o;
    /* The byte-level symbol of each byte must be in the vocab: every text must be encodable. */
    for (int b = 0; b < 256; b++) {
        char sym[4];
        size_t n = dsv4_utf8_put(sym, cp[b]);
        if ((tok->byte_id[b] = str_lookup(tok, sym, n)) < 0)
            return dsv4_error_set(-EINVAL, "model.vocab has no symbol for byte 0x%02x", b);
    }
    return 0;
}

static int build_tries(struct dsv4_tokenizer *tok)
{
    size_t raw = 0, norm = 0;
    for (size_t i = 0; i < tok->nadded; i++)
        *(tok->added[i].normalized ? &norm : &raw) += strlen(tok->added[i].content);
    if (trie_init(&tok->trie_raw, raw) || trie_init(&tok->trie_norm, norm))
        return dsv4_error_set(-ENOMEM, "out of memory for the added-token tries");
    for (size_t i = 0; i < tok->nadded; i++)
        trie_add(tok->added[i].normalized ? &tok->trie_norm : &tok->trie_raw, tok->added[i].content,
                 (int32_t)i);
    return 0;
}

int dsv4_tokenizer_load(const char *path, struct dsv4_tokenizer **ret_tok)
{
    *ret_tok = NULL;
    pthread_once(&onig_once, onig_setup);
    struct stat st;
    if (stat(path, &st))
        return dsv4_error_set(-errno, "tokenizer %s: %s", path, strerror(errno));
    if ((size_t)st.st_size > DSV4_TOK_MAX_FILE_BYTES)
        return dsv4_error_set(-EFBIG, "tokenizer %s: %lld bytes, more than the limit of %zu", path,
                              (long long)st.st_size, DSV4_TOK_MAX_FILE_BYTES);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        return dsv4_error_set(-EINVAL, "tokenizer %s: line %d: %s", path, jerr.line, jerr.text);
    struct dsv4_tokenizer *tok = calloc(1, sizeof(*tok));
    int r = tok ? 0 : dsv4_error_set(-ENOMEM, "out of memory");
    const json_t *model = json_object_get(root, "model");
    if (!r)
        r = check_parts(root);
    if (!r)
        r = load_vocab(tok, json_object_get(model, "vocab"), json_object_get(root, "added_tokens"));
    if (!r)
        r = load_merges(tok, json_object_get(model, "merges"));
    if (!r)
        r = build_bytes(tok);
    if (!r)
        r = build_tries(tok);
    if (!r)
        r = load_pre_tokenizer(tok, root);
    if (!r) {
        if (!(tok->cache = calloc(1, sizeof(*tok->cache))))
            r = dsv4_error_set(-ENOMEM, "out of memory for the word cache");
        else
            for (size_t i = 0; i < TOK_CACHE_LOCKS; i++)
                pthread_mutex_init(&tok->cache->lock[i], NULL);
    }
    json_decref(root);
    if (r) {
        dsv4_error_prefix(r, "tokenizer %s: ", path);
        dsv4_tokenizer_free(tok);
        return r;
    }
    *ret_tok = tok;
    return 0;
}

/* ---- lookups ---- */

size_t dsv4_tokenizer_vocab_size(const struct dsv4_tokenizer *tok)
{
    return tok->nids;
}

static bool id_known(const struct dsv4_tokenizer *tok, int32_t id)
{
    return id >= 0 && (size_t)id < tok->nids && tok->str[id];
}

const char *dsv4_tokenizer_token_bytes(const struct dsv4_tokenizer *tok, int32_t id, size_t *ret_len)
{
    if (!id_known(tok, id))
        return NULL;
    *ret_len = tok->bytes_off[id + 1] - tok->bytes_off[id];
    return tok->bytes + tok->bytes_off[id];
}

const char *dsv4_tokenizer_token_string(const struct dsv4_tokenizer *tok, int32_t id)
{
    return id_known(tok, id) ? tok->str[id] : NULL;
}

int32_t dsv4_tokenizer_added_id(const struct dsv4_tokenizer *tok, const char *content)
{
    for (size_t i = 0; i < tok->nadded; i++)
        if (!strcmp(tok->added[i].content, content))
            return tok->added[i].id;
    return dsv4_error_set(-ENOENT, "tokenizer has no added token \"%s\"", content);
}

int32_t dsv4_tokenizer_token_id(const struct dsv4_tokenizer *tok, const char *token_string)
{
    int32_t id = str_lookup(tok, token_string, strlen(token_string));
    return id >= 0 ? id : dsv4_error_set(-ENOENT, "tokenizer has no token \"%s\"", token_string);
}

bool dsv4_tokenizer_is_special(const struct dsv4_tokenizer *tok, int32_t id)
{
    return id_known(tok, id) && (tok->flags[id] & TOK_ID_SPECIAL);
}

bool dsv4_tokenizer_is_added(const struct dsv4_tokenizer *tok, int32_t id)
{
    return id_known(tok, id) && (tok->flags[id] & TOK_ID_ADDED);
}

/* ---- encoding ---- */

/* BPE work queue: a binary min-heap of rank << 32 | position (lowest rank first, then leftmost).
 * A rank names one pair, so a queued entry is still valid when the pair now at its position has
 * the same rank. */
static void heap_sift_down(uint64_t *h, size_t n, size_t i, uint64_t key)
{
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && h[c + 1] < h[c])
            c++;
        if (key <= h[c])
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = key;
}

static void heap_push(uint64_t *h, size_t *n, uint64_t key)
{
    size_t i = (*n)++;
    while (i) {
        size_t parent = (i - 1) / 2;
        if (h[parent] <= key)
            break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = key;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0];
    if (--(*n))
        heap_sift_down(h, *n, 0, h[*n]);
    return top;
}

/* The queue key of the pair (pos, next), or UINT64_MAX when it does not merge. */
static uint64_t pair_key(const struct dsv4_tokenizer *tok, const int32_t *sym, int32_t pos, int32_t next)
{
    const struct tok_merge_slot *m = merge_find(tok, sym[pos], sym[next]);
    return m ? ((uint64_t)m->rank << 32) | (uint32_t)pos : UINT64_MAX;
}

/* Merge the byte symbols of one word by rank (lowest first, leftmost among equals: what the
 * library's heap does) and append the ids. O(n log n) in the word length. */
static int bpe_word(const struct dsv4_tokenizer *tok, const unsigned char *p, size_t n,
                    struct dsv4_tok_ids *out)
{
    int32_t sym_s[TOK_WORD_STACK], next_s[TOK_WORD_STACK], prev_s[TOK_WORD_STACK];
    uint64_t heap_s[3 * TOK_WORD_STACK];
    int32_t *sym = sym_s, *next = next_s, *prev = prev_s;
    uint64_t *heap = heap_s;
    void *mem = NULL;
    if (n > TOK_WORD_STACK) {
        if (n > INT32_MAX / 4)
            return dsv4_error_set(-E2BIG, "tokenizer: a single word of %zu bytes is too long", n);
        /* Each merge queues at most 2 pairs after the n - 1 initial ones: 3n entries. */
        mem = malloc(n * (3 * sizeof(int32_t) + 3 * sizeof(uint64_t)));
        if (!mem)
            return dsv4_error_set(-ENOMEM, "tokenizer: out of memory for a word of %zu bytes", n);
        heap = mem;
        sym = (int32_t *)(heap + 3 * n);
        next = sym + n;
        prev = next + n;
    }
    size_t nh = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = tok->byte_id[p[i]];
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint64_t key = pair_key(tok, sym, (int32_t)i, (int32_t)i + 1);
        if (key != UINT64_MAX)
            heap[nh++] = key;
    }
    for (size_t i = nh / 2; i-- > 0;)
        heap_sift_down(heap, nh, i, heap[i]);
    while (nh) {
        uint64_t key = heap_pop(heap, &nh);
        int32_t pos = (int32_t)(uint32_t)key;
        int32_t right = next[pos];
        if (sym[pos] < 0 || right < 0)
            continue;
        const struct tok_merge_slot *m = merge_find(tok, sym[pos], sym[right]);
        if (!m || m->rank != key >> 32)
            continue;  /* stale: a neighbour changed since this pair was queued */
        sym[pos] = m->new_id;
        sym[right] = -1;
        next[pos] = next[right];
        if (next[pos] >= 0)
            prev[next[pos]] = pos;
        if (prev[pos] >= 0 && (key = pair_key(tok, sym, prev[pos], pos)) != UINT64_MAX)
            heap_push(heap, &nh, key);
        if (next[pos] >= 0 && (key = pair_key(tok, sym, pos, next[pos])) != UINT64_MAX)
            heap_push(heap, &nh, key);
    }
    int r = ids_reserve(out, n);
    if (!r)
        for (int32_t i = 0; i >= 0; i = next[i])
            out->ids[out->len++] = sym[i];
    free(mem);
    return r;
}

static int encode_word(const struct dsv4_tokenizer *tok, const unsigned char *p, size_t n,
                       struct dsv4_tok_ids *out)
{
    if (n == 1)
        return dsv4_tok_ids_push(out, tok->byte_id[p[0]]);
    if (n > TOK_CACHE_WORD_MAX)
        return bpe_word(tok, p, n, out);
    uint64_t h = dsv4_tok_hash_bytes(p, n);
    size_t slot = h & (TOK_CACHE_SLOTS - 1);
    struct tok_cache_slot *c = &tok->cache->slot[slot];
    pthread_mutex_t *lock = &tok->cache->lock[slot % TOK_CACHE_LOCKS];
    int r = ids_reserve(out, n);
    if (r)
        return r;
    pthread_mutex_lock(lock);
    if (c->len == n && c->hash == h && !memcmp(c->word, p, n)) {
        memcpy(out->ids + out->len, c->ids, c->nids * sizeof(int32_t));
        out->len += c->nids;
        pthread_mutex_unlock(lock);
        return 0;
    }
    pthread_mutex_unlock(lock);
    size_t start = out->len;
    if ((r = bpe_word(tok, p, n, out)))
        return r;
    pthread_mutex_lock(lock);
    c->hash = h;
    c->len = (uint8_t)n;
    c->nids = (uint8_t)(out->len - start);
    memcpy(c->word, p, n);
    memcpy(c->ids, out->ids + start, c->nids * sizeof(int32_t));
    pthread_mutex_unlock(lock);
    return 0;
}

struct tok_encode {
    const struct dsv4_tokenizer *tok;
    OnigRegion *region[TOK_MAX_REGEXES];  /* one per regex: the scans nest */
    struct dsv4_tok_ids *out;
    unsigned flags;
    /* dsv4_tokenizer_encode_parts(): the only byte ranges [start, end) of the text, starting at base,
     * where an added token may be recognised; n_windows 0 means the whole text. Sorted, disjoint. */
    const unsigned char *base;
    const size_t (*windows)[2];
    size_t n_windows;
};

struct tok_scan {
    struct tok_encode *e;
    size_t level;
    const unsigned char *p;    /* the piece being split */
    const unsigned char *pos;  /* end of the last match */
    int err;
};

static int pre_tokenize(struct tok_encode *e, size_t level, const unsigned char *p, size_t n);

static int scan_match(int nth, int at, OnigRegion *region, void *arg)
{
    struct tok_scan *s = arg;
    const unsigned char *ms = s->p + region->beg[0], *me = s->p + region->end[0];
    if (me == ms)
        s->err = dsv4_error_set(-EINVAL, "tokenizer: regex %zu matched empty text", s->level);
    else if (!(s->err = pre_tokenize(s->e, s->level + 1, s->pos, (size_t)(ms - s->pos))))
        s->err = pre_tokenize(s->e, s->level + 1, ms, (size_t)(me - ms));
    s->pos = me;
    return s->err ? -1 : 0;
}

/* Split by regex `level` (Isolated: matches and the gaps between them are pieces, in order), each
 * piece going on to the next regex; after the last one, BPE. onig_scan keeps one match state for
 * all matches of a piece, which is much cheaper than a search per match. */
static int pre_tokenize(struct tok_encode *e, size_t level, const unsigned char *p, size_t n)
{
    if (!n)
        return 0;
    if (level == e->tok->nregex)
        return encode_word(e->tok, p, n, e->out);
    if (!e->region[level] && !(e->region[level] = onig_region_new()))
        return dsv4_error_set(-ENOMEM, "tokenizer: out of memory");
    struct tok_scan s = {.e = e, .level = level, .p = p, .pos = p};
    int r = onig_scan(e->tok->regex[level], p, p + n, e->region[level], ONIG_OPTION_NONE, scan_match, &s);
    if (s.err)
        return s.err;
    if (r < 0) {
        /* Oniguruma's backtracking limit: a huge run the regex backtracks over (10M whitespace
         * characters in the V4 file's), where `tokenizers` fails as well. */
        UChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
        onig_error_code_to_str(msg, r);
        return dsv4_error_set(-EINVAL, "tokenizer: split regex %zu gave up on the text after byte %zu: %s", level,
                              (size_t)(s.pos - e->base), (char *)msg);
    }
    return pre_tokenize(e, level + 1, s.pos, (size_t)(p + n - s.pos));
}

/* First window of e that ends after text offset `off`. */
static size_t first_window(const struct tok_encode *e, size_t off)
{
    size_t lo = 0, hi = e->n_windows;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (e->windows[mid][1] <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Pass `pass` of the added-token split: 0 finds tokens with normalized=false in the raw text,
 * 1 finds normalized=true tokens in what pass 0 left. A token is recognised only wholly inside a
 * window (the whole piece when there are none). */
static int split_added(struct tok_encode *e, int pass, const unsigned char *p, size_t n)
{
    if (pass == 2 || (e->flags & DSV4_TOK_ENCODE_ADDED_AS_TEXT))
        return pre_tokenize(e, 0, p, n);
    const struct tok_trie *t = pass == 0 ? &e->tok->trie_raw : &e->tok->trie_norm;
    size_t off = e->n_windows ? (size_t)(p - e->base) : 0;
    size_t gap = 0;
    int r;
    for (size_t w = e->n_windows ? first_window(e, off) : 0; w < (e->n_windows ? e->n_windows : 1); w++) {
        /* The window in piece coordinates, clipped to the piece. */
        size_t ws = 0, we = n;
        if (e->n_windows) {
            if (e->windows[w][0] >= off + n)
                break;
            ws = e->windows[w][0] > off ? e->windows[w][0] - off : 0;
            we = e->windows[w][1] - off < n ? e->windows[w][1] - off : n;
        }
        size_t from = ws > gap ? ws : gap;
        for (;;) {
            size_t mend = we;   /* set by trie_find on a match; initialized for older gcc's flow analysis */
            int32_t index = 0;
            size_t ms = trie_find(t, p, we, from, &mend, &index);
            if (ms == we)
                break;
            const struct tok_added *a = &e->tok->added[index];
            from = mend;
            /* Skipped specials still consume their text, like the library's matcher. */
            if (a->special && (e->flags & DSV4_TOK_ENCODE_SPECIAL_AS_TEXT))
                continue;
            if ((r = split_added(e, pass + 1, p + gap, ms - gap)) || (r = dsv4_tok_ids_push(e->out, a->id)))
                return r;
            gap = mend;
        }
    }
    return split_added(e, pass + 1, p + gap, n - gap);
}

static int encode_checked(struct tok_encode *e, const char *text, size_t len)
{
    if (e->flags & ~(unsigned)(DSV4_TOK_ENCODE_SPECIAL_AS_TEXT | DSV4_TOK_ENCODE_ADDED_AS_TEXT))
        return dsv4_error_set(-EINVAL, "tokenizer: unknown encode flags 0x%x", e->flags);
    if (len > DSV4_TOK_MAX_TEXT_BYTES)
        return dsv4_error_set(-E2BIG, "tokenizer: text of %zu bytes exceeds the limit of %zu", len,
                              DSV4_TOK_MAX_TEXT_BYTES);
    const unsigned char *p = (const unsigned char *)text;
    size_t bad = dsv4_utf8_valid_prefix(text, len);
    if (bad != len)
        return dsv4_error_set(-EILSEQ, "tokenizer: text is not valid UTF-8 at byte %zu", bad);
    if (!len)
        return 0;
    e->base = p;
    int r = split_added(e, 0, p, len);
    for (size_t i = 0; i < TOK_MAX_REGEXES; i++)
        if (e->region[i])
            onig_region_free(e->region[i], 1);
    return r;
}

int dsv4_tokenizer_encode(const struct dsv4_tokenizer *tok, const char *text, size_t len,
                          unsigned flags, struct dsv4_tok_ids *out)
{
    struct tok_encode e = {.tok = tok, .out = out, .flags = flags};
    return encode_checked(&e, text, len);
}

int dsv4_tokenizer_encode_parts(const struct dsv4_tokenizer *tok, const char *const *parts, const size_t *lens,
                                size_t n, unsigned flags, struct dsv4_tok_ids *out)
{
    size_t total = 0, n_windows = 0;
    for (size_t i = 0; i < n; i++) {
        if (lens[i] > DSV4_TOK_MAX_TEXT_BYTES - total)
            return dsv4_error_set(-E2BIG, "tokenizer: parts of more than %zu bytes", DSV4_TOK_MAX_TEXT_BYTES);
        total += lens[i];
    }
    char *text = malloc(total ? total : 1);
    size_t (*windows)[2] = malloc(sizeof(*windows) * (n / 2 + 1));
    if (!text || !windows) {
        free(text);
        free(windows);
        return dsv4_error_set(-ENOMEM, "tokenizer: out of memory");
    }
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (i % 2 == 0 && lens[i]) {
            windows[n_windows][0] = at;
            windows[n_windows][1] = at + lens[i];
            n_windows++;
        }
        memcpy(text + at, parts[i], lens[i]);
        at += lens[i];
    }
    /* No window at all must still forbid every added token: an empty window at the end does. */
    if (!n_windows) {
        windows[0][0] = windows[0][1] = total;
        n_windows = 1;
    }
    struct tok_encode e = {.tok = tok, .out = out, .flags = flags, .windows = (const size_t (*)[2])windows,
                           .n_windows = n_windows};
    int r = encode_checked(&e, text, total);
    free(text);
    free(windows);
    return r;
}

/* ---- decoding ---- */

int dsv4_tokenizer_decode(const struct dsv4_tokenizer *tok, const int32_t *ids, size_t n,
                          unsigned flags, char **ret_bytes, size_t *ret_len)
{
    *ret_bytes = NULL;
    if (flags & ~(unsigned)DSV4_TOK_DECODE_SKIP_SPECIAL)
        return dsv4_error_set(-EINVAL, "tokenizer: unknown decode flags 0x%x", flags);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!id_known(tok, ids[i]))
            return dsv4_error_set(-ERANGE, "tokenizer: id %d at position %zu is not in the vocabulary "
                                  "(size %zu)", ids[i], i, tok->nids);
        total += tok->bytes_off[ids[i] + 1] - tok->bytes_off[ids[i]];
    }
    char *out = malloc(total + 1);
    if (!out)
        return dsv4_error_set(-ENOMEM, "tokenizer: out of memory decoding %zu ids", n);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if ((flags & DSV4_TOK_DECODE_SKIP_SPECIAL) && (tok->flags[ids[i]] & TOK_ID_SPECIAL))
            continue;
        size_t len = tok->bytes_off[ids[i] + 1] - tok->bytes_off[ids[i]];
        memcpy(out + o, tok->bytes + tok->bytes_off[ids[i]], len);
        o += len;
    }
    out[o] = '\0';
    *ret_bytes = out;
    *ret_len = o;
    return 0;
}

struct dsv4_detok {
    const struct dsv4_tokenizer *tok;
    unsigned flags;
    unsigned char pending[4];  /* the start of a character still waiting for bytes (at most 3) */
    size_t npending;
    char *out;
    size_t out_cap;
};

int dsv4_detok_new(const struct dsv4_tokenizer *tok, unsigned decode_flags, struct dsv4_detok **ret)
{
    *ret = NULL;
    if (decode_flags & ~(unsigned)DSV4_TOK_DECODE_SKIP_SPECIAL)
        return dsv4_error_set(-EINVAL, "detokenizer: unknown decode flags 0x%x", decode_flags);
    struct dsv4_detok *d = calloc(1, sizeof(*d));
    if (!d)
        return dsv4_error_set(-ENOMEM, "detokenizer: out of memory");
    d->tok = tok;
    d->flags = decode_flags;
    *ret = d;
    return 0;
}

void dsv4_detok_free(struct dsv4_detok *d)
{
    if (!d)
        return;
    free(d->out);
    free(d);
}

int dsv4_detok_feed(struct dsv4_detok *d, int32_t id, const char **ret_bytes, size_t *ret_len)
{
    size_t n;
    const unsigned char *b = (const unsigned char *)dsv4_tokenizer_token_bytes(d->tok, id, &n);
    if (!b)
        return dsv4_error_set(-ERANGE, "detokenizer: id %d is not in the vocabulary (size %zu)", id,
                              d->tok->nids);
    if ((d->flags & DSV4_TOK_DECODE_SKIP_SPECIAL) && (d->tok->flags[id] & TOK_ID_SPECIAL))
        n = 0;
    /* Output: pending + n bytes, each byte at worst becoming a 3-byte U+FFFD. */
    size_t need = 3 * (d->npending + n) + 1;
    if (need > d->out_cap) {
        char *o = realloc(d->out, need);
        if (!o)
            return dsv4_error_set(-ENOMEM, "detokenizer: out of memory");
        d->out = o;
        d->out_cap = need;
    }
    size_t o = 0, i = 0;
    /* Complete the pending character first; it can take at most 3 more bytes. */
    while (d->npending) {
        unsigned char tmp[4];
        size_t take = n - i < 4 - d->npending ? n - i : 4 - d->npending;
        memcpy(tmp, d->pending, d->npending);
        memcpy(tmp + d->npending, b + i, take);
        size_t used;
        enum dsv4_utf8_step st = dsv4_utf8_step(tmp, d->npending + take, &used);
        if (st == DSV4_UTF8_INCOMPLETE) {
            memcpy(d->pending + d->npending, b + i, take);
            d->npending += take;
            i += take;
            break;
        }
        if (st == DSV4_UTF8_VALID)
            memcpy(d->out + o, tmp, used);
        else
            memcpy(d->out + o, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
        o += st == DSV4_UTF8_VALID ? used : 3;
        /* `used` may end inside the pending bytes (an invalid subpart): re-queue the rest. */
        if (used < d->npending) {
            size_t rest = d->npending - used;
            memmove(d->pending, d->pending + used, rest);
            d->npending = rest;
        } else {
            i += used - d->npending;
            d->npending = 0;
        }
    }
    while (i < n) {
        size_t used;
        enum dsv4_utf8_step st = dsv4_utf8_step(b + i, n - i, &used);
        if (st == DSV4_UTF8_INCOMPLETE) {
            memcpy(d->pending, b + i, used);
            d->npending = used;
            break;
        }
        if (st == DSV4_UTF8_VALID) {
            memcpy(d->out + o, b + i, used);
            o += used;
        } else {
            memcpy(d->out + o, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
            o += 3;
        }
        i += used;
    }
    d->out[o] = '\0';
    *ret_bytes = d->out;
    *ret_len = o;
    return 0;
}

int dsv4_detok_flush(struct dsv4_detok *d, const char **ret_bytes, size_t *ret_len)
{
    if (d->out_cap < 4) {
        char *o = realloc(d->out, 4);
        if (!o)
            return dsv4_error_set(-ENOMEM, "detokenizer: out of memory");
        d->out = o;
        d->out_cap = 4;
    }
    size_t o = 0;
    if (d->npending) {
        memcpy(d->out, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
        o = 3;
    }
    d->npending = 0;
    d->out[o] = '\0';
    *ret_bytes = d->out;
    *ret_len = o;
    return 0;
}
