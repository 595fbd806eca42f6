/* run.c: placeholder until the subcommand lands; reports that it is not built yet. */
#include "tool.h"

#include <stdio.h>

int tool_run(int argc, char **argv) {
    (void)argc;
    fprintf(stderr, "pkv: '%s' is not implemented yet\n", argv[0]);
    return TOOL_FAIL;
}
