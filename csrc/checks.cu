// Kernels of cupy_memstrat.checks, compiled at run time through CuPy (NVRTC):
// users need no compiler. They never allocate: results go to buffers the
// checking layer set aside in advance (cupy_memstrat/cuda.py, CheckKernels).
//
// memstrat_verify: are the bytes [start, end) of the block at `ptr` all equal
// to `pattern` (a poison or canary byte)? Each thread counts the bytes that
// differ; a thread that found any adds its count to results[2*slot], lowers
// results[2*slot+1] (initially ULLONG_MAX) to the first differing offset, and
// sets the host-mapped word `flag` to 1 (a plain store, seen by the host
// without a synchronisation, so that a finding is noticed at the next
// allocation). Integer arguments arrive as 64-bit ints (CuPy passes Python
// ints as int64).

extern "C" __global__ void memstrat_verify(
    long long ptr, long long start, long long end, long long pattern,
    long long results, long long slot, long long flag)
{
    const unsigned char* p = (const unsigned char*)ptr;
    const unsigned char b = (unsigned char)pattern;
    const unsigned long long word = 0x0101010101010101ULL * (unsigned long long)b;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;

    // [start, a0): bytes up to the first 8-byte aligned address;
    // [a0, a1): 8-byte words; [a1, end): the bytes after the last word.
    long long a0 = start + ((8 - ((ptr + start) & 7)) & 7);
    if (a0 > end) a0 = end;
    const long long a1 = a0 + ((end - a0) & ~7LL);

    unsigned long long bad = 0;
    unsigned long long first = ~0ULL;
    for (long long i = start + tid; i < a0; i += nthreads) {
        if (p[i] != b) { ++bad; if ((unsigned long long)i < first) first = i; }
    }
    for (long long i = a1 + tid; i < end; i += nthreads) {
        if (p[i] != b) { ++bad; if ((unsigned long long)i < first) first = i; }
    }
    const unsigned long long* w = (const unsigned long long*)(p + a0);
    const long long nwords = (a1 - a0) >> 3;
    for (long long i = tid; i < nwords; i += nthreads) {
        const unsigned long long v = w[i];
        if (v != word) {
            for (int k = 0; k < 8; ++k) {
                if ((unsigned char)(v >> (8 * k)) != b) {
                    ++bad;
                    const unsigned long long off = a0 + 8 * i + k;
                    if (off < first) first = off;
                }
            }
        }
    }
    if (bad) {
        unsigned long long* r = (unsigned long long*)results + 2 * slot;
        atomicAdd(r, bad);
        atomicMin(r + 1, first);
        *(volatile unsigned int*)flag = 1u;
    }
}
