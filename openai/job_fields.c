/* SPDX-License-Identifier: MIT */
/* A request's fields (openai/job_internal.h): each checked against its type and range, a refusal naming
 * the field. */
#include "build-config.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "openai/job_internal.h"

int oai_bad(struct oai_bad *b, const char *param, const char *fmt, ...)
{
    va_list ap;
    b->param = param;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof(b->msg), fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* An optional field: absent or null leaves *v. */
int oai_opt_number(const json_t *root, const char *key, double lo, double hi, double *v, bool *given,
                   struct oai_bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_number(o))
        return oai_bad(b, key, "%s must be a number", key);
    double x = json_number_value(o);
    if (!(x >= lo && x <= hi))
        return oai_bad(b, key, "%s is %g, must be in [%g, %g]", key, x, lo, hi);
    *v = x;
    if (given)
        *given = true;
    return 0;
}

int oai_opt_int(const json_t *root, const char *key, json_int_t lo, json_int_t hi, json_int_t *v, bool *given,
                struct oai_bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_integer(o))
        return oai_bad(b, key, "%s must be an integer", key);
    json_int_t x = json_integer_value(o);
    if (x < lo || x > hi)
        return oai_bad(b, key, "%s is %" JSON_INTEGER_FORMAT ", must be in [%" JSON_INTEGER_FORMAT ", %" JSON_INTEGER_FORMAT
                   "]", key, x, lo, hi);
    *v = x;
    if (given)
        *given = true;
    return 0;
}

int oai_opt_bool(const json_t *root, const char *key, bool *v, struct oai_bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_boolean(o))
        return oai_bad(b, key, "%s must be true or false", key);
    *v = json_is_true(o);
    return 0;
}

int oai_parse_common(struct oai_gen_request *g, uint32_t default_max_tokens, struct oai_bad *b)
{
    json_t *root = g->root;
    struct dsv4_client_generate_params *p = &g->p;
    double x;
    json_int_t n;
    bool given = false;
    int rc = 0;
    const json_t *o;

    if ((o = json_object_get(root, "model")) && !json_is_string(o) && !json_is_null(o))
        return oai_bad(b, "model", "model must be a string");
    if ((rc = oai_opt_bool(root, "stream", &g->stream, b)))
        return rc;
    if ((o = json_object_get(root, "stream_options")) && !json_is_null(o)) {
        if (!json_is_object(o))
            return oai_bad(b, "stream_options", "stream_options must be an object");
        if ((rc = oai_opt_bool(o, "include_usage", &g->include_usage, b))) {
            b->param = "stream_options.include_usage";
            return rc;
        }
    }
    n = 1;
    if ((rc = oai_opt_int(root, "n", 1, DSV4_OAI_MAX_CHOICES, &n, NULL, b)))
        return rc;
    g->n = (int)n;
    n = 1;
    if ((rc = oai_opt_int(root, "best_of", 1, 1, &n, NULL, b)))
        return rc;
    /* max_completion_tokens is the newer name; it wins when both are given. */
    n = default_max_tokens;
    if ((rc = oai_opt_int(root, "max_tokens", 1, 1 << 20, &n, NULL, b)) ||
        (rc = oai_opt_int(root, "max_completion_tokens", 1, 1 << 20, &n, NULL, b)))
        return rc;
    p->max_tokens = (uint32_t)n;
    x = 1;
    if ((rc = oai_opt_number(root, "temperature", 0, 2, &x, NULL, b)))
        return rc;
    p->temperature = (float)x;
    x = 1;
    if ((rc = oai_opt_number(root, "top_p", 0, 1, &x, NULL, b)))
        return rc;
    p->top_p = (float)x;
    n = 0;
    if ((rc = oai_opt_int(root, "top_k", -1, INT32_MAX, &n, NULL, b)))
        return rc;
    p->top_k = n < 0 ? 0 : (int32_t)n;
    x = 0;
    if ((rc = oai_opt_number(root, "min_p", 0, 1, &x, NULL, b)))
        return rc;
    p->min_p = (float)x;
    x = 0;
    if ((rc = oai_opt_number(root, "presence_penalty", -2, 2, &x, NULL, b)))
        return rc;
    p->presence_penalty = (float)x;
    x = 0;
    if ((rc = oai_opt_number(root, "frequency_penalty", -2, 2, &x, NULL, b)))
        return rc;
    p->frequency_penalty = (float)x;
    x = 1;
    if ((rc = oai_opt_number(root, "repetition_penalty", 1e-6, 10, &x, NULL, b)))
        return rc;
    p->repetition_penalty = (float)x;
    n = 0;
    if ((rc = oai_opt_int(root, "seed", INT64_MIN, INT64_MAX, &n, &given, b)))
        return rc;
    p->has_seed = given;
    p->seed = (uint64_t)n;   /* negative seeds are as good as any: two's complement */

    if ((o = json_object_get(root, "stop")) && !json_is_null(o)) {
        if (json_is_string(o)) {
            g->stop[p->n_stop++] = json_string_value(o);
        } else if (json_is_array(o)) {
            size_t i;
            const json_t *s;
            if (json_array_size(o) > DSV4_CLIENT_MAX_STOP)
                return oai_bad(b, "stop", "stop has %zu strings, at most %d", json_array_size(o), DSV4_CLIENT_MAX_STOP);
            json_array_foreach(o, i, s) {
                if (!json_is_string(s))
                    return oai_bad(b, "stop", "stop[%zu] must be a string", i);
                g->stop[p->n_stop++] = json_string_value(s);
            }
        } else {
            return oai_bad(b, "stop", "stop must be a string or an array of strings");
        }
        for (size_t i = 0; i < p->n_stop; i++)
            if (!g->stop[i][0] || strlen(g->stop[i]) > 256)
                return oai_bad(b, "stop", "stop strings must be 1 to 256 bytes");
        p->stop = g->stop;
    }
    if ((o = json_object_get(root, "stop_token_ids")) && !json_is_null(o)) {
        size_t i;
        const json_t *v;
        if (!json_is_array(o) || json_array_size(o) > DSV4_CLIENT_MAX_STOP_TOKEN_IDS)
            return oai_bad(b, "stop_token_ids", "stop_token_ids must be an array of at most %d token ids",
                       DSV4_CLIENT_MAX_STOP_TOKEN_IDS);
        json_array_foreach(o, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
                return oai_bad(b, "stop_token_ids", "stop_token_ids[%zu] must be a token id", i);
            g->stop_ids[i] = (int32_t)json_integer_value(v);
        }
        p->stop_token_ids = g->stop_ids;
        p->n_stop_token_ids = json_array_size(o);
    }
    if ((o = json_object_get(root, "logit_bias")) && !json_is_null(o) &&
        !(json_is_object(o) && json_object_size(o) == 0))
        return oai_bad(b, "logit_bias", "logit_bias is not supported");
    if ((o = json_object_get(root, "user")) && !json_is_string(o) && !json_is_null(o))
        return oai_bad(b, "user", "user must be a string");
    return 0;
}

/* Parse the body; on failure the job has its 400 and NULL comes back. */
json_t *oai_parse_body(struct dsv4_oai_job *j)
{
    json_error_t jerr;
    json_t *root = json_loadb(j->body ? j->body : "", j->body_len, 0, &jerr);
    if (!root) {
        char msg[300];
        snprintf(msg, sizeof(msg), "the body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                 jerr.column);
        oai_respond_error(j, 400, "invalid_request_error", NULL, "invalid_json", msg);
        return NULL;
    }
    if (!json_is_object(root)) {
        oai_respond_error(j, 400, "invalid_request_error", NULL, "invalid_json", "the body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    return root;
}

void oai_respond_bad(struct dsv4_oai_job *j, const struct oai_bad *b)
{
    oai_respond_error(j, 400, "invalid_request_error", b->param, "invalid_value", b->msg);
}

/* Thinking mode: chat_template_kwargs {"thinking": true} (or "enable_thinking"), or a reasoning
 * effort other than "none". DeepSeek's "max" effort (and OpenAI's "xhigh") adds its effort prompt. */
int oai_parse_thinking(const json_t *root, struct dsv4_render_opts *o, struct oai_bad *b)
{
    const json_t *kw = json_object_get(root, "chat_template_kwargs"), *eff = json_object_get(root, "reasoning_effort");
    int rc;
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw))
            return oai_bad(b, "chat_template_kwargs", "chat_template_kwargs must be an object");
        if ((rc = oai_opt_bool(kw, "thinking", &o->thinking, b)) ||
            (rc = oai_opt_bool(kw, "enable_thinking", &o->thinking, b))) {
            b->param = "chat_template_kwargs";
            return rc;
        }
    }
    if (eff && !json_is_null(eff)) {
        static const char *const efforts[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
        size_t k, n = sizeof(efforts) / sizeof(efforts[0]);
        if (!json_is_string(eff))
            return oai_bad(b, "reasoning_effort", "reasoning_effort must be a string");
        for (k = 0; k < n; k++)
            if (strcmp(json_string_value(eff), efforts[k]) == 0)
                break;
        if (k == n)
            return oai_bad(b, "reasoning_effort", "reasoning_effort '%s' is not one of none, minimal, low, medium, high, "
                       "xhigh, max", json_string_value(eff));
        if (k > 0)
            o->thinking = true;
        o->effort_max = k >= 5;
    }
    return 0;
}

/* tools and tool_choice: "none" hides the tools; a named function offers only that one (the choice is
 * not enforced by constrained decoding; "required" is as "auto"). Returns the tools to render. */
int oai_parse_tools(const json_t *root, json_t **ret_tools, struct oai_bad *b)
{
    const json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice");
    /* Checked even without tools: a wrong type is an error wherever it is. */
    *ret_tools = NULL;
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return oai_bad(b, "tools", "tools must be an array");
    if (json_array_size(tools) > 128)
        return oai_bad(b, "tools", "%zu tools, at most 128", json_array_size(tools));
    if (choice && !json_is_null(choice) && !json_is_string(choice) && !json_is_object(choice))
        return oai_bad(b, "tool_choice", "tool_choice must be a string or an object");
    if (!json_array_size(tools))
        return 0;
    if (choice && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            const char *c = json_string_value(choice);
            if (strcmp(c, "none") == 0)
                return 0;
            if (strcmp(c, "auto") != 0 && strcmp(c, "required") != 0)
                return oai_bad(b, "tool_choice", "tool_choice '%s' is not none, auto, required or a function", c);
        } else if (json_is_object(choice)) {
            const json_t *name = json_object_get(json_object_get(choice, "function"), "name");
            if (!json_is_string(name))
                return oai_bad(b, "tool_choice", "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
            size_t i;
            const json_t *t;
            json_array_foreach(tools, i, t) {
                const json_t *tn = json_object_get(json_object_get(t, "function"), "name");
                if (json_is_string(tn) && strcmp(json_string_value(tn), json_string_value(name)) == 0) {
                    *ret_tools = json_pack("[O]", t);
                    return *ret_tools ? 0 : -ENOMEM;
                }
            }
            return oai_bad(b, "tool_choice", "tool_choice names '%s', which is not in tools", json_string_value(name));
        }
    }
    *ret_tools = json_incref((json_t *)tools);
    return 0;
}
