/* bench.instructions: a callgrind dump on demand, from Python through ctypes.
 * CALLGRIND_DUMP_STATS writes the counts since the last dump (every thread) and zeroes them;
 * outside valgrind the client request is a few no-op instructions. */
#include <valgrind/callgrind.h>

void cg_dump(void) { CALLGRIND_DUMP_STATS; }
