/* text.wordcount: the words, lines, characters and bytes of a text argument.
 *
 * No capability: it sees no file, no network and no model; what it counts is in its
 * arguments. A word is a run of characters other than ASCII white space (as wc(1) counts
 * them); a line is what an editor shows, so a last line without a newline counts too;
 * characters are Unicode code points. */
#include "cogni_tool.h"

static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

int main(void) {
    ct_value args = ct_read_arguments("text.wordcount");
    size_t len;
    const char *text = ct_string_arg(args, "text", 1, &len);
    unsigned long long words = 0, lines = 0, chars = 0;
    int in_word = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if ((c & 0xC0) != 0x80) chars++; /* not a continuation byte: a code point starts */
        if (c == '\n') lines++;
        if (is_space(c)) {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            words++;
        }
    }
    if (len > 0 && text[len - 1] != '\n') lines++;
    printf("{\"words\": %llu, \"lines\": %llu, \"chars\": %llu, \"bytes\": %zu}", words, lines,
           chars, len);
    ct_finish();
}
