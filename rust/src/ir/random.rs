//! kiln's random numbers, defined once for the interpreter; runtime.cuh's `kiln::philox`,
//! `kiln::randomFloat` and `kiln::randomDouble` compute the same bits on the GPU.
//!
//! The element at row-major position `i` of a random tensor is drawn from one Philox
//! 4x32-10 block (Salmon et al., the generator of cuRAND and nvFuser): counter
//! `(i_lo, i_hi, offset_lo, offset_hi)`, key `(seed_lo, seed_hi)`. Its value depends on the
//! seed, the offset and `i` alone, never on the schedule. Uniform floats take the top 24
//! (f32) or 53 (f64) bits: `u` in `[0, 1)`, then `fma(u, b - a, a)`. Normals use Box–Muller
//! on two such uniforms (the first shifted into `(0, 1]`), then `fma(z, std, mean)`.

use crate::ir::RandomDist;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32 with 10 rounds.
pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The Philox block of element `index` of a tensor drawn with `seed` and `offset`.
pub fn block(seed: i64, offset: i64, index: i64) -> [u32; 4] {
    let (s, o, i) = (seed as u64, offset as u64, index as u64);
    philox([i as u32, (i >> 32) as u32, o as u32, (o >> 32) as u32], [s as u32, (s >> 32) as u32])
}

/// The f32 draw of `dist` with parameters `a`, `b` from block `r`.
pub fn draw_f32(dist: RandomDist, a: f32, b: f32, r: [u32; 4]) -> f32 {
    let unit = |x: u32| (x >> 8) as f32 * (1.0 / 16_777_216.0);
    match dist {
        RandomDist::Uniform => unit(r[0]).mul_add(b - a, a),
        RandomDist::Normal => {
            let u1 = ((r[0] >> 8) + 1) as f32 * (1.0 / 16_777_216.0);
            let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * unit(r[1])).cos();
            z.mul_add(b, a)
        }
    }
}

/// The f64 draw of `dist` with parameters `a`, `b` from block `r`.
pub fn draw_f64(dist: RandomDist, a: f64, b: f64, r: [u32; 4]) -> f64 {
    let bits = |hi: u32, lo: u32| (u64::from(hi) << 21) | (u64::from(lo) >> 11);
    let unit = |hi: u32, lo: u32| bits(hi, lo) as f64 * (1.0 / 9_007_199_254_740_992.0);
    match dist {
        RandomDist::Uniform => unit(r[0], r[1]).mul_add(b - a, a),
        RandomDist::Normal => {
            let u1 = (bits(r[0], r[1]) + 1) as f64 * (1.0 / 9_007_199_254_740_992.0);
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * unit(r[2], r[3])).cos();
            z.mul_add(b, a)
        }
    }
}

/// A uniform draw `v` in `dt`, kept below `b`: rounding `a + u * (b - a)` to the output type
/// can reach `b` (bfloat16 keeps 8 bits, so about one draw in 256 near `b` would), and
/// `[a, b)` must stay half-open. Such a draw becomes the largest `dt` value below `b`.
/// Returns the value as f64 (exact in every floating dtype).
pub fn uniform_below(v: f64, a: f64, b: f64, dt: crate::ir::DataType) -> f64 {
    use crate::ir::DataType;
    use half::{bf16, f16};
    if a.partial_cmp(&b) != Some(std::cmp::Ordering::Less) {
        return v;
    }
    match dt {
        DataType::Double => {
            if v >= b {
                b.next_down()
            } else {
                v
            }
        }
        DataType::Half => below_16bit(v, b, |x| f16::from_f64(x).to_bits(), |u| f64::from(f16::from_bits(u))),
        DataType::BFloat16 => below_16bit(v, b, |x| bf16::from_f64(x).to_bits(), |u| f64::from(bf16::from_bits(u))),
        _ => {
            let (r, bf) = (v as f32, b as f32);
            if f64::from(r) < b {
                return f64::from(r);
            }
            let c = if f64::from(bf) >= b { bf.next_down() } else { bf };
            f64::from(c)
        }
    }
}

/// `v` rounded to a 16-bit float type (`to_bits` rounds, `value` reads bits back), or the
/// largest value of that type below `b` where the rounding reaches `b`.
fn below_16bit(v: f64, b: f64, to_bits: impl Fn(f64) -> u16, value: impl Fn(u16) -> f64) -> f64 {
    let r = value(to_bits(v));
    if r < b {
        return r;
    }
    let c = to_bits(b);
    if value(c) >= b {
        value(step_down(c))
    } else {
        value(c)
    }
}

/// The next 16-bit float (half or bfloat16 bits) towards minus infinity.
fn step_down(bits: u16) -> u16 {
    if bits & 0x7fff == 0 {
        0x8001 // below +-0: the negative value of least magnitude
    } else if bits & 0x8000 == 0 {
        bits - 1
    } else {
        bits + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_known_answer() {
        // Random123's kat_vectors: philox4x32_10 of counter 0 and key 0.
        assert_eq!(philox([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        let pi = [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344];
        assert_eq!(philox(pi, [0xa409_3822, 0x299f_31d0]), [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]);
    }

    #[test]
    fn uniforms_stay_in_range() {
        for i in 0..1000 {
            let r = block(7, 3, i);
            let (x, y) = (draw_f32(RandomDist::Uniform, -1.0, 2.0, r), draw_f64(RandomDist::Uniform, 0.0, 1.0, r));
            assert!((-1.0..2.0).contains(&x) && (0.0..1.0).contains(&y));
            assert!(draw_f32(RandomDist::Normal, 0.0, 1.0, r).is_finite());
        }
    }
}
