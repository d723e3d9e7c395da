// Emulation of the PTX fragment semantics the MLA kernels rely on, for the host harnesses under tests/csrc/:
//   ldmatrix: lanes 8i..8i+7 address the rows of matrix i; register i of thread t = (M_i[t/4][2(t%4)],
//             M_i[t/4][2(t%4)+1]); .trans: (M_i[2(t%4)][t/4], M_i[2(t%4)+1][t/4]); low half = first element.
//   mma A: a0 (g, 2q4..), a1 (g+8, 2q4..), a2 (g, 2q4+8..), a3 (g+8, 2q4+8..); B: b0 (k 2q4.., n g), b1 (k 2q4+8..);
//   C: c0,c1 (g, 2q4, 2q4+1), c2,c3 (g+8, ...).
// Values are kept exact as doubles; shared memory records how often each element was written, so a read of an element
// written zero or several times fails, and every ldmatrix phase is checked for bank conflicts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <set>
#include <vector>

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      if (failures < 20) {                \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);         \
        std::printf("\n");                \
      }                                   \
      ++failures;                         \
    }                                     \
  } while (0)

struct Reg {  // a 32-bit register holding two 16-bit elements (values kept exact as doubles)
  double lo = 0, hi = 0;
};

// smem of bf16 elements, addressed in bytes
struct Smem {
  std::vector<double> v;
  std::vector<int> written;
  explicit Smem(int bytes) : v(bytes / 2, 1e300), written(bytes / 2, 0) {}
  void put(uint32_t byte_off, double x) {
    CHECK(byte_off % 2 == 0 && byte_off / 2 < v.size(), "smem store out of range %u", byte_off);
    v[byte_off / 2] = x;
    written[byte_off / 2]++;
  }
  double get(uint32_t byte_off) const {
    CHECK(byte_off / 2 < v.size(), "smem load out of range %u", byte_off);
    CHECK(written[byte_off / 2] == 1, "smem load of a byte written %d times (off %u)", written[byte_off / 2], byte_off);
    return v[byte_off / 2];
  }
};

static void check_phase(const uint32_t (&addr)[32], int bytes) {
  for (int i = 0; i < 4; ++i) {
    std::set<int> banks;
    for (int j = 0; j < 8; ++j) {
      const uint32_t a = addr[8 * i + j];
      CHECK(a % 16 == 0 && a + 16 <= static_cast<uint32_t>(bytes), "ldmatrix row address %u", a);
      banks.insert((a / 16) % 8);
    }
    CHECK(banks.size() == 8, "ldmatrix matrix %d: bank conflict (%zu distinct 16-B bank groups)", i, banks.size());
  }
}

static void ldsm_x4(const Smem& s, const uint32_t (&addr)[32], bool trans, Reg (&out)[32][4], int bytes) {
  check_phase(addr, bytes);
  for (int i = 0; i < 4; ++i) {
    double M[8][8];
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 8; ++c) M[r][c] = s.get(addr[8 * i + r] + 2 * c);
    for (int t = 0; t < 32; ++t) {
      if (!trans) {
        out[t][i].lo = M[t / 4][2 * (t % 4)];
        out[t][i].hi = M[t / 4][2 * (t % 4) + 1];
      } else {
        out[t][i].lo = M[2 * (t % 4)][t / 4];
        out[t][i].hi = M[2 * (t % 4) + 1][t / 4];
      }
    }
  }
}

// d[lane][4] += A B with per-lane fragments; B is registers 2 pair, 2 pair + 1 of each lane's ldmatrix.x4, as the kernel passes them
static void mma(double (&d)[32][4], const Reg (&a)[32][4], const Reg (&b)[32][4], int pair) {
  double A[16][16], B[16][8];
  for (int t = 0; t < 32; ++t) {
    const int g = t / 4, q = t % 4;
    A[g][2 * q] = a[t][0].lo;
    A[g][2 * q + 1] = a[t][0].hi;
    A[g + 8][2 * q] = a[t][1].lo;
    A[g + 8][2 * q + 1] = a[t][1].hi;
    A[g][2 * q + 8] = a[t][2].lo;
    A[g][2 * q + 9] = a[t][2].hi;
    A[g + 8][2 * q + 8] = a[t][3].lo;
    A[g + 8][2 * q + 9] = a[t][3].hi;
    B[2 * q][g] = b[t][2 * pair].lo;
    B[2 * q + 1][g] = b[t][2 * pair].hi;
    B[2 * q + 8][g] = b[t][2 * pair + 1].lo;
    B[2 * q + 9][g] = b[t][2 * pair + 1].hi;
  }
  for (int t = 0; t < 32; ++t) {
    const int g = t / 4, q = t % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * q + (e & 1);
      double acc = 0;
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[t][e] += acc;
    }
  }
}

