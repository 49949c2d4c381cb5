#!/usr/bin/env bash
# The 8-bit-activation quant kernels built with VNNI (quant_common.h's dot_u8s8: vpdpbusd)
# against their AVX2 build, bit for bit, on any AVX2 machine: qemu-x86_64 (Debian: apt-get
# install qemu-user) emulates a CPU with AVX-VNNI where this one has none.
#
# Builds tests/kernels/vnni_check.c with quant_matmul.c and quant_kquants.c twice, with
# -mavx2 -mfma -mf16c and with the same plus -mavxvnni, checks by objdump that only the second
# holds vpdpbusd, then runs the AVX2 build natively and both builds under qemu and compares
# their outputs' hashes (the AVX2 build under qemu too, so that a difference can only come
# from the dot product). With --march, also compiles the kernels for the CPUs of the fleet
# that have VNNI (AVX512-VNNI's EVEX form: icelake-server, znver4; both forms: sapphirerapids)
# and checks that each build holds vpdpbusd.
#
# Exit status: 0 the same bits; 1 a difference or a failed step; 77 qemu missing or unable to
# run AVX-VNNI (Debian 12's QEMU 7.2 stops at vpdpbusd with SIGILL), nothing compared. The two
# builds take about 40 s on the 2-core EPYC (--march: 25 s more); qemu's runs are untimed, no
# qemu here having run them. tests/kernels/test_quant_vnni.py runs it without --march.
set -euo pipefail
cd "$(dirname "$0")/.."
QEMU=${QEMU:-qemu-x86_64}
QEMU_CPU=${QEMU_CPU:-max}
march=0
[[ "${1:-}" == "--march" ]] && march=1
work=$(mktemp -d "${TMPDIR:-/tmp}/pagedlm-vnni.XXXXXX")
trap 'rm -rf "$work"' EXIT
csrc=pagedlm/csrc
kernels=("$csrc/quant_matmul.c" "$csrc/quant_kquants.c")
flags=(-O3 -fopenmp -I"$csrc/include" -mavx2 -mfma -mf16c)

count() { objdump -d --no-show-raw-insn "$1" | grep -c "$2" || true; }
status=0
if [[ $march == 1 ]]; then
    for arch in icelake-server znver4 sapphirerapids; do
        if ! gcc -march="$arch" -x c -c /dev/null -o /dev/null 2>/dev/null; then
            echo "check_vnni: -march=$arch: not known to $(gcc --version | head -1), skipped"
            continue
        fi
        for source in "${kernels[@]}"; do
            obj="$work/$arch-$(basename "$source" .c).o"
            gcc -O3 -fopenmp -march="$arch" -c "$source" -o "$obj"
            n=$(count "$obj" vpdpbusd)
            echo "check_vnni: -march=$arch $(basename "$source"): $n vpdpbusd" \
                 "($(count "$obj" '{vex} vpdpbusd') VEX)"
            [[ $n != 0 ]] || status=1
        done
    done
fi

if ! command -v "$QEMU" >/dev/null; then
    echo "check_vnni: $QEMU not found (Debian: apt-get install qemu-user)" >&2
    exit $((status ? 1 : 77))
fi
# 4 byte products in one lane: qemu versions without AVX-VNNI stop at its first instruction.
cat >"$work/probe.c" <<'EOF'
#include <immintrin.h>
#include <stdint.h>
int main(void) {
    volatile int a = 0x01ff8004, b = -0x05067f08;
    const __m256i r = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(1), _mm256_set1_epi32(a),
                                              _mm256_set1_epi32(b));
    int want = 1;
    for (int i = 0; i < 4; i++) want += (uint8_t)(a >> 8 * i) * (int8_t)(b >> 8 * i);
    return _mm256_extract_epi32(r, 7) == want ? 0 : 1;
}
EOF
gcc -O2 -mavx2 -mavxvnni "$work/probe.c" -o "$work/probe"
rc=0
("$QEMU" -cpu "$QEMU_CPU" "$work/probe"; exit $?) 2>"$work/probe.err" || rc=$?
if [[ $rc != 0 ]]; then  # 132: SIGILL; 1: a wrong sum
    echo "check_vnni: $("$QEMU" --version | head -1) -cpu $QEMU_CPU cannot run AVX-VNNI" \
         "(exit $rc): $(grep -m1 qemu: "$work/probe.err" || true)" >&2
    exit $((status ? 1 : 77))
fi

gcc "${flags[@]}" "${kernels[@]}" tests/kernels/vnni_check.c -o "$work/avx2" -lm &
gcc "${flags[@]}" -mavxvnni "${kernels[@]}" tests/kernels/vnni_check.c -o "$work/vnni" -lm
wait $!
if [[ $(count "$work/avx2" vpdpbusd) != 0 || $(count "$work/vnni" vpdpbusd) == 0 ]]; then
    echo "check_vnni: vpdpbusd expected in the -mavxvnni build only" >&2
    exit 1
fi

"$work/avx2" >"$work/native.txt"
"$QEMU" -cpu "$QEMU_CPU" "$work/avx2" >"$work/qemu-avx2.txt"
"$QEMU" -cpu "$QEMU_CPU" "$work/vnni" >"$work/qemu-vnni.txt"
verdict="the same bits"
for run in qemu-avx2 qemu-vnni; do
    if ! diff "$work/native.txt" "$work/$run.txt" >"$work/$run.diff"; then
        echo "check_vnni: $run differs from the native AVX2 run:" >&2
        cat "$work/$run.diff" >&2
        verdict=DIFFERENT
        status=1
    fi
done
echo "check_vnni: $(wc -l <"$work/native.txt") runs," \
     "$(count "$work/vnni" vpdpbusd) vpdpbusd in the VNNI build: $verdict"
exit $status
