/* cogni_tool.h: the tool protocol of gatewayd's wasm tools, for C compiled to wasm32-wasi.
 *
 * One call is one run of the module (a WASI preview 1 command):
 *
 *   stdin   {"arguments": {...}}   (gatewayd writes it whole, then closes stdin)
 *   stdout  one JSON value: the call's result
 *   exit 0  done; any other status is the call's failure (`tool_failed`), and the end of
 *           stderr is its message. Bad arguments exit CT_EXIT_BAD_INPUT with a sentence
 *           naming the argument.
 *
 * What a tool may touch is what its manifest declares and the calling run grants: the
 * granted workspace paths are preopened at their sandbox names (/workspace/src), nothing
 * else exists, and there is no network. A tool that declares `model_access` asks the host's
 * model with ct_model_chat(), which is a `model.chat` gateway call of the calling run
 * (its policy, review, audit and model budget apply).
 *
 * The JSON reader is our own: no single-header C JSON parser is packaged on PyPI or npm,
 * the only places this build takes anything from, and the examples need little (an
 * object's string, integer and boolean members). It checks the whole document as strict
 * JSON (RFC 8259: grammar, escapes, UTF-8, no control character in a string, nothing after
 * the value) before any member is read, so a tool never acts on half a document; nesting
 * is bounded (CT_MAX_DEPTH), so the recursion is too. A member named twice is refused:
 * two readers of one document must never see two different values.
 *
 * Everything is `static`: each tool is one C file including this header, and what it
 * does not call is not linked (a tool that never asks the model imports nothing from
 * "cogni").
 */
#ifndef COGNI_TOOL_H
#define COGNI_TOOL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A call's input is one gateway frame's arguments: gatewayd's largest frame is 1 MiB by
 * default and 16 MiB at most (max_frame_bytes), so more than that is not a call. */
#define CT_MAX_INPUT_BYTES ((size_t)16 << 20)
/* Deeper than any argument schema of the examples nests: bounds the reader's recursion
 * (a wasm stack is small). */
#define CT_MAX_DEPTH 64
/* A model answer is at most gatewayd's largest model reply (max_reply_bytes: 256 MiB is
 * its ceiling, 8 MiB its default) in a small envelope: the examples keep 8 MiB. */
#define CT_MAX_ANSWER_BYTES ((size_t)8 << 20)

#define CT_EXIT_FAILED 1
#define CT_EXIT_BAD_INPUT 2

#define CT_UNUSED __attribute__((unused))

/* The tool's name in its messages; set by ct_read_arguments. */
static const char *ct_tool_name = "tool";

/* Print "<tool>: <message>" on stderr and exit with `status`. */
CT_UNUSED __attribute__((noreturn, format(printf, 2, 3))) static void ct_die(int status,
                                                                             const char *fmt,
                                                                             ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "%s: ", ct_tool_name);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

/* malloc that never returns NULL: out of memory ends the call (the runner's limit). */
CT_UNUSED static void *ct_alloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL) ct_die(CT_EXIT_FAILED, "out of memory (%zu bytes)", n);
    return p;
}

/* ---- UTF-8 ------------------------------------------------------------------------- */

/* Length of the well-formed UTF-8 sequence at s (at most n bytes), or 0 when there is
 * none (overlong forms, surrogates and code points past U+10FFFF are not well-formed). */
static size_t ct_utf8_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return 0; /* overlong */
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;                           /* surrogate */
    if (cp > 0x10FFFF) return 0;
    return len;
}

/* ---- reading JSON ---------------------------------------------------------------------- */

/* One JSON value of a checked document: [start, end) of its text. */
typedef struct {
    const char *start;
    const char *end;
} ct_value;

typedef struct {
    const char *p;
    const char *end;
    int depth;
} ct_cursor;

static void ct_skip_ws(ct_cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int ct_hex4(const char *p, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char h = p[i];
        v <<= 4;
        if (h >= '0' && h <= '9') v |= (uint32_t)(h - '0');
        else if (h >= 'a' && h <= 'f') v |= (uint32_t)(h - 'a' + 10);
        else if (h >= 'A' && h <= 'F') v |= (uint32_t)(h - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* Check the string at c->p (its opening quote) and move past it; when `out` is given,
 * write its decoded UTF-8 there (it needs at most the string's own length) and its
 * length to *out_len. Returns 0, or -1 for a string that is not valid JSON. */
static int ct_string(ct_cursor *c, char *out, size_t *out_len) {
    size_t w = 0;
    if (c->p >= c->end || *c->p != '"') return -1;
    c->p++;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            c->p++;
            if (out_len) *out_len = w;
            return 0;
        }
        if (ch < 0x20) return -1; /* control characters must be escaped */
        if (ch == '\\') {
            if (c->end - c->p < 2) return -1;
            char e = c->p[1];
            const char *simple = strchr("\"\\/bfnrt", e);
            if (e != '\0' && simple != NULL) {
                static const char decoded[] = "\"\\/\b\f\n\r\t";
                if (out) out[w] = decoded[simple - "\"\\/bfnrt"];
                w++;
                c->p += 2;
                continue;
            }
            if (e != 'u' || c->end - c->p < 6) return -1;
            uint32_t cp;
            if (ct_hex4(c->p + 2, &cp) != 0) return -1;
            c->p += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return -1; /* a lone low surrogate */
            if (cp >= 0xD800 && cp <= 0xDBFF) {           /* a pair, or nothing */
                uint32_t low;
                if (c->end - c->p < 6 || c->p[0] != '\\' || c->p[1] != 'u') return -1;
                if (ct_hex4(c->p + 2, &low) != 0 || low < 0xDC00 || low > 0xDFFF) return -1;
                c->p += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            /* Encode cp as UTF-8: never longer than the escape it came from. */
            char buf[4];
            size_t n;
            if (cp < 0x80) {
                buf[0] = (char)cp;
                n = 1;
            } else if (cp < 0x800) {
                buf[0] = (char)(0xC0 | (cp >> 6));
                buf[1] = (char)(0x80 | (cp & 0x3F));
                n = 2;
            } else if (cp < 0x10000) {
                buf[0] = (char)(0xE0 | (cp >> 12));
                buf[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[2] = (char)(0x80 | (cp & 0x3F));
                n = 3;
            } else {
                buf[0] = (char)(0xF0 | (cp >> 18));
                buf[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[3] = (char)(0x80 | (cp & 0x3F));
                n = 4;
            }
            if (out) memcpy(out + w, buf, n);
            w += n;
            continue;
        }
        size_t n = ct_utf8_len((const unsigned char *)c->p, (size_t)(c->end - c->p));
        if (n == 0) return -1;
        if (out) memcpy(out + w, c->p, n);
        w += n;
        c->p += n;
    }
    return -1; /* no closing quote */
}

static int ct_digits(ct_cursor *c) {
    const char *start = c->p;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') c->p++;
    return c->p > start ? 0 : -1;
}

static int ct_number(ct_cursor *c) {
    if (c->p < c->end && *c->p == '-') c->p++;
    if (c->p < c->end && *c->p == '0') {
        c->p++;
    } else if (ct_digits(c) != 0) {
        return -1;
    }
    if (c->p < c->end && *c->p == '.') {
        c->p++;
        if (ct_digits(c) != 0) return -1;
    }
    if (c->p < c->end && (*c->p == 'e' || *c->p == 'E')) {
        c->p++;
        if (c->p < c->end && (*c->p == '+' || *c->p == '-')) c->p++;
        if (ct_digits(c) != 0) return -1;
    }
    return 0;
}

static int ct_literal(ct_cursor *c, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return -1;
    c->p += n;
    return 0;
}

/* Check the value at c->p and move past it (and the whitespace before it). */
static int ct_skip_value(ct_cursor *c) {
    ct_skip_ws(c);
    if (c->p >= c->end) return -1;
    switch (*c->p) {
        case '"':
            return ct_string(c, NULL, NULL);
        case 't':
            return ct_literal(c, "true");
        case 'f':
            return ct_literal(c, "false");
        case 'n':
            return ct_literal(c, "null");
        case '{':
        case '[': {
            char close = *c->p == '{' ? '}' : ']';
            int object = close == '}';
            if (++c->depth > CT_MAX_DEPTH) return -1;
            c->p++;
            ct_skip_ws(c);
            if (c->p < c->end && *c->p == close) {
                c->p++;
                c->depth--;
                return 0;
            }
            for (;;) {
                if (object) {
                    ct_skip_ws(c);
                    if (ct_string(c, NULL, NULL) != 0) return -1;
                    ct_skip_ws(c);
                    if (c->p >= c->end || *c->p != ':') return -1;
                    c->p++;
                }
                if (ct_skip_value(c) != 0) return -1;
                ct_skip_ws(c);
                if (c->p >= c->end) return -1;
                if (*c->p == ',') {
                    c->p++;
                    continue;
                }
                if (*c->p != close) return -1;
                c->p++;
                c->depth--;
                return 0;
            }
        }
        default:
            return ct_number(c);
    }
}

/* Check that [text, text+len) is exactly one JSON value (whitespace around it allowed). */
static int ct_parse(const char *text, size_t len, ct_value *out) {
    ct_cursor c = {text, text + len, 0};
    ct_skip_ws(&c);
    const char *start = c.p;
    if (ct_skip_value(&c) != 0) return -1;
    const char *end = c.p;
    ct_skip_ws(&c);
    if (c.p != c.end) return -1;
    out->start = start;
    out->end = end;
    return 0;
}

static int ct_is(ct_value v, char first) { return v.start < v.end && *v.start == first; }
CT_UNUSED static int ct_is_object(ct_value v) { return ct_is(v, '{'); }
CT_UNUSED static int ct_is_string(ct_value v) { return ct_is(v, '"'); }
CT_UNUSED static int ct_is_null(ct_value v) { return ct_is(v, 'n'); }

/* The member `key` of the checked object `obj`: 1 and its value in *out, or 0 when it
 * has none. A key the object names twice ends the call: the document is ambiguous. */
static int ct_member(ct_value obj, const char *key, ct_value *out) {
    ct_cursor c = {obj.start + 1, obj.end, 0};
    size_t key_len = strlen(key);
    int found = 0;
    ct_skip_ws(&c);
    if (c.p < c.end && *c.p == '}') return 0;
    for (;;) {
        ct_skip_ws(&c);
        ct_cursor probe = c;
        if (ct_string(&probe, NULL, NULL) != 0) return found; /* checked already */
        /* The decoded name is never longer than its text. */
        char *decoded = ct_alloc((size_t)(probe.p - c.p));
        size_t name_len = 0;
        ct_string(&c, decoded, &name_len);
        int match = name_len == key_len && memcmp(decoded, key, key_len) == 0;
        free(decoded);
        ct_skip_ws(&c);
        c.p++; /* ':' */
        ct_skip_ws(&c);
        const char *value_start = c.p;
        ct_skip_value(&c);
        if (match) {
            if (found) ct_die(CT_EXIT_BAD_INPUT, "the member \"%s\" is given twice", key);
            found = 1;
            out->start = value_start;
            out->end = c.p;
        }
        ct_skip_ws(&c);
        if (c.p >= c.end || *c.p != ',') return found;
        c.p++;
    }
}

/* The decoded text of the checked string value `v`, NUL-terminated (malloc'd); its length
 * in *len. The text may hold NUL bytes (\u0000): check *len where that matters. */
static char *ct_string_value(ct_value v, size_t *len) {
    ct_cursor c = {v.start, v.end, 0};
    char *out = ct_alloc((size_t)(v.end - v.start) + 1);
    size_t n = 0;
    ct_string(&c, out, &n);
    out[n] = '\0';
    if (len) *len = n;
    return out;
}

/* Read stdin whole, check it is {"arguments": {...}}, and return the arguments object.
 * Anything else ends the call with CT_EXIT_BAD_INPUT. */
CT_UNUSED static ct_value ct_read_arguments(const char *tool_name) {
    ct_tool_name = tool_name;
    size_t cap = 64 << 10, len = 0;
    char *buf = ct_alloc(cap);
    for (;;) {
        if (len == cap) {
            if (cap >= CT_MAX_INPUT_BYTES)
                ct_die(CT_EXIT_BAD_INPUT, "the input is longer than %zu bytes",
                       CT_MAX_INPUT_BYTES);
            cap *= 2;
            char *grown = realloc(buf, cap);
            if (grown == NULL) ct_die(CT_EXIT_FAILED, "out of memory reading the input");
            buf = grown;
        }
        size_t n = fread(buf + len, 1, cap - len, stdin);
        len += n;
        if (n == 0) {
            if (ferror(stdin)) ct_die(CT_EXIT_FAILED, "stdin could not be read");
            break;
        }
    }
    ct_value doc, args;
    if (ct_parse(buf, len, &doc) != 0)
        ct_die(CT_EXIT_BAD_INPUT, "the input is not one JSON value (expected {\"arguments\": {...}})");
    if (!ct_is_object(doc) || !ct_member(doc, "arguments", &args) || !ct_is_object(args))
        ct_die(CT_EXIT_BAD_INPUT, "the input is not {\"arguments\": {...}}");
    return args; /* buf stays allocated: args points into it */
}

/* The string argument `key`: decoded, NUL-terminated, without NUL bytes inside. Absent:
 * NULL when optional, else the call ends (CT_EXIT_BAD_INPUT), as for any other type. */
CT_UNUSED static char *ct_string_arg(ct_value args, const char *key, int required,
                                     size_t *len) {
    ct_value v;
    if (!ct_member(args, key, &v) || ct_is_null(v)) {
        if (required) ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" is required", key);
        return NULL;
    }
    if (!ct_is_string(v)) ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be a string", key);
    size_t n;
    char *s = ct_string_value(v, &n);
    if (strlen(s) != n) ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" contains a NUL", key);
    if (len) *len = n;
    return s;
}

/* The integer argument `key` within [min, max]; `fallback` when absent or null. */
CT_UNUSED static long long ct_int_arg(ct_value args, const char *key, long long fallback,
                                      long long min, long long max) {
    ct_value v;
    if (!ct_member(args, key, &v) || ct_is_null(v)) return fallback;
    long long n = 0;
    const char *p = v.start;
    int negative = p < v.end && *p == '-';
    if (negative) p++;
    if (p == v.end) ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be an integer", key);
    for (int digits = 0; p < v.end; p++) {
        if (*p < '0' || *p > '9')
            ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be an integer", key);
        /* 18 digits always fit a long long; more is past any bound a tool sets. */
        if (++digits > 18)
            ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be an integer from %lld to %lld",
                   key, min, max);
        n = n * 10 + (*p - '0');
    }
    if (negative) n = -n;
    if (n < min || n > max)
        ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be an integer from %lld to %lld",
               key, min, max);
    return n;
}

/* The boolean argument `key`; `fallback` when absent or null. */
CT_UNUSED static int ct_bool_arg(ct_value args, const char *key, int fallback) {
    ct_value v;
    if (!ct_member(args, key, &v) || ct_is_null(v)) return fallback;
    if (ct_is(v, 't')) return 1;
    if (ct_is(v, 'f')) return 0;
    ct_die(CT_EXIT_BAD_INPUT, "the argument \"%s\" must be true or false", key);
}

/* ---- writing JSON ---------------------------------------------------------------------- */

/* `s` (n bytes) as a JSON string on `f`: escaped, and any byte that is not well-formed
 * UTF-8 written as U+FFFD (a file's contents need not be text), so the output is always
 * valid JSON. */
CT_UNUSED static void ct_put_string(FILE *f, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        unsigned char ch = u[i];
        if (ch == '"' || ch == '\\') {
            fputc('\\', f);
            fputc(ch, f);
            i++;
        } else if (ch < 0x20 || ch == 0x7F) {
            fprintf(f, "\\u%04x", ch);
            i++;
        } else {
            size_t len = ct_utf8_len(u + i, n - i);
            if (len == 0) {
                fputs("\\ufffd", f);
                i++;
            } else {
                fwrite(u + i, 1, len, f);
                i += len;
            }
        }
    }
    fputc('"', f);
}

/* End the call: the result is written; exit 0, or CT_EXIT_FAILED if stdout failed. */
CT_UNUSED __attribute__((noreturn)) static void ct_finish(void) {
    fputc('\n', stdout);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "%s: the result could not be written\n", ct_tool_name);
        exit(CT_EXIT_FAILED);
    }
    exit(0);
}

/* ---- the host's model (module "cogni") -------------------------------------------------- */

/* Send a model.chat request (its arguments as JSON: {"model", "messages", ...}); the host
 * keeps its answer and returns the answer's length in bytes (negative: the request could
 * not be taken, e.g. it lies outside the module's memory). */
__attribute__((import_module("cogni"), import_name("model_chat"))) extern int32_t
cogni_model_chat(const char *request, int32_t request_len);

/* Copy the kept answer into buf (at most buf_len bytes); returns the bytes copied. */
__attribute__((import_module("cogni"), import_name("response_read"))) extern int32_t
cogni_response_read(char *buf, int32_t buf_len);

/* Ask the host's model. Returns the answer document, checked JSON, whose text stays
 * allocated: {"ok": true, "value": {"model", "content", "usage"}} or {"ok": false,
 * "errorCode": "...", "message": "..."}. A request the host cannot take ends the call. */
CT_UNUSED static ct_value ct_model_chat(const char *request, size_t request_len) {
    if (request_len > (size_t)INT32_MAX) ct_die(CT_EXIT_FAILED, "the model request is too long");
    int32_t n = cogni_model_chat(request, (int32_t)request_len);
    if (n < 0) ct_die(CT_EXIT_FAILED, "the host refused the model request (%d)", (int)n);
    if ((size_t)n > CT_MAX_ANSWER_BYTES)
        ct_die(CT_EXIT_FAILED, "the model's answer is longer than %zu bytes", CT_MAX_ANSWER_BYTES);
    char *answer = ct_alloc((size_t)n + 1);
    int32_t got = cogni_response_read(answer, n);
    if (got != n) ct_die(CT_EXIT_FAILED, "the model's answer was cut (%d of %d bytes)", (int)got, (int)n);
    ct_value doc;
    if (ct_parse(answer, (size_t)n, &doc) != 0 || !ct_is_object(doc))
        ct_die(CT_EXIT_FAILED, "the host's answer is not a JSON object");
    return doc;
}

#endif /* COGNI_TOOL_H */
