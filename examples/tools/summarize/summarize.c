/* text.summarize: a summary of a text, written by the host's model.
 *
 * Capability: model access (the manifest's `model_access` alias "default"). The module
 * has no network: it asks the host through the "cogni" import (ct_model_chat), and the
 * host makes that a `model.chat` gateway call of the calling run, so the run's policy
 * (its model aliases), review, audit and model budget all apply; the provider's key never
 * leaves the host. A refused or failed model call fails this call, with the gateway's
 * error code and message on stderr. */
#include "cogni_tool.h"

/* The alias asked for unless the call names another: the one the manifest declares. A
 * run may lend the tool only the aliases both the manifest and the run's policy name. */
#define DEFAULT_MODEL "default"
#define DEFAULT_WORDS 60
#define MAX_WORDS 1000
/* The answer's token cap: generous for MAX_WORDS words. */
#define MAX_TOKENS_PER_WORD 3

/* A growing buffer for the request. */
typedef struct {
    char *data;
    size_t len, cap;
} buffer;

static void put(buffer *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (b->len + n + 1 > cap) cap *= 2;
        char *grown = realloc(b->data, cap);
        if (grown == NULL) ct_die(CT_EXIT_FAILED, "out of memory building the request");
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void put_str(buffer *b, const char *s) { put(b, s, strlen(s)); }

/* s as a JSON string: the header writes to a FILE, so through an in-memory one. */
static void put_json_string(buffer *b, const char *s, size_t n) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL) ct_die(CT_EXIT_FAILED, "out of memory building the request");
    ct_put_string(f, s, n);
    fclose(f);
    put(b, text, len);
    free(text);
}

int main(void) {
    ct_value args = ct_read_arguments("text.summarize");
    size_t text_len;
    const char *text = ct_string_arg(args, "text", 1, &text_len);
    const char *model = ct_string_arg(args, "model", 0, NULL);
    if (model == NULL) model = DEFAULT_MODEL;
    long long words = ct_int_arg(args, "max_words", DEFAULT_WORDS, 1, MAX_WORDS);

    char instruction[160];
    snprintf(instruction, sizeof instruction,
             "Summarize the user's text in at most %lld words. Answer with the summary only.",
             words);
    buffer request = {0};
    put_str(&request, "{\"model\": ");
    put_json_string(&request, model, strlen(model));
    put_str(&request, ", \"messages\": [{\"role\": \"system\", \"content\": ");
    put_json_string(&request, instruction, strlen(instruction));
    put_str(&request, "}, {\"role\": \"user\", \"content\": ");
    put_json_string(&request, text, text_len);
    char tail[64];
    snprintf(tail, sizeof tail, "}], \"max_tokens\": %lld}", words * MAX_TOKENS_PER_WORD + 16);
    put_str(&request, tail);

    ct_value answer = ct_model_chat(request.data, request.len);
    ct_value ok, value, content;
    if (!ct_member(answer, "ok", &ok) || !ct_is(ok, 't')) {
        ct_value code, message;
        char *code_text = ct_member(answer, "errorCode", &code) && ct_is_string(code)
                              ? ct_string_value(code, NULL)
                              : "unknown";
        char *message_text = ct_member(answer, "message", &message) && ct_is_string(message)
                                 ? ct_string_value(message, NULL)
                                 : "";
        ct_die(CT_EXIT_FAILED, "the model call was refused: %s: %s", code_text, message_text);
    }
    if (!ct_member(answer, "value", &value) || !ct_is_object(value) ||
        !ct_member(value, "content", &content) || !ct_is_string(content))
        ct_die(CT_EXIT_FAILED, "the model's answer has no text");
    size_t summary_len;
    char *summary = ct_string_value(content, &summary_len);
    printf("{\"summary\": ");
    ct_put_string(stdout, summary, summary_len);
    printf(", \"model\": ");
    ct_put_string(stdout, model, strlen(model));
    ct_value usage;
    if (ct_member(value, "usage", &usage) && ct_is_object(usage))
        printf(", \"usage\": %.*s", (int)(usage.end - usage.start), usage.start);
    printf("}");
    ct_finish();
}
