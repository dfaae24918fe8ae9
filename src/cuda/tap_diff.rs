//! Comparing taps where they are: reference taps kept in GPU memory and each path tap diffed
//! against them by `kernels/diff.cu`, so only a dozen numbers per row leave the GPU.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Arg, Gpu};
use crate::diff::RowDiff;
use crate::tap::{DeviceTap, Recorded, TapId};

/// A reference tap copied to contiguous GPU memory.
pub struct DeviceRecorded {
    pub step: usize,
    pub id: TapId,
    pub positions: Vec<usize>,
    pub shape: Vec<usize>,
    pub rows_per_token: usize,
    pub width: usize,
    pub data: CudaSlice<f32>,
    gpu: Arc<Gpu>,
}

impl DeviceRecorded {
    pub fn copy(step: usize, t: &DeviceTap<'_>) -> Self {
        let g = t.gpu;
        let data = g.alloc::<f32>(t.rows * t.width);
        g.launch(
            "copy_rows",
            t.rows as u32,
            256,
            0,
            &[
                Arg::Ptr(t.ptr),
                Arg::I32(t.stride as i32),
                Arg::I32(t.width as i32),
                Arg::Ptr(ptr(g, &data, 0)),
            ],
        );
        DeviceRecorded {
            step,
            id: t.id,
            positions: t.positions.to_vec(),
            shape: t.shape.clone(),
            rows_per_token: t.rows_per_token,
            width: t.width,
            data,
            gpu: g.clone(),
        }
    }

    /// The same tap on the host.
    pub fn to_host(&self) -> Recorded {
        Recorded {
            step: self.step,
            id: self.id,
            positions: self.positions.clone(),
            shape: self.shape.clone(),
            data: self.gpu.download(
                &self.data,
                self.positions.len() * self.rows_per_token * self.width,
            ),
        }
    }
}

/// Diff summaries of many taps gathered in one GPU buffer and read back in one copy.
#[derive(Default)]
pub struct DeviceDiffs {
    out: Option<CudaSlice<f32>>,
    gpu: Option<Arc<Gpu>>,
    cap: usize,
    used: usize,
}

impl DeviceDiffs {
    /// Queues the diff of the path tap's rows against reference rows: `b_rows` per row (-1:
    /// none), or rows `b_row0..` when `None`. Returns the first output row, or `None` when the
    /// buffer is full (drain it, then queue again).
    pub fn enqueue(
        &mut self,
        t: &DeviceTap<'_>,
        r: &DeviceRecorded,
        b_rows: Option<&[i32]>,
        b_row0: usize,
    ) -> Option<usize> {
        let g = t.gpu;
        if self.out.is_none() {
            self.cap = (1 << 20).max(t.rows);
            self.out = Some(g.alloc::<f32>(self.cap * 12));
            self.gpu = Some(g.clone());
        }
        if self.used + t.rows > self.cap {
            return None;
        }
        let out = self.out.as_ref().expect("allocated");
        let idx = b_rows.map(|b| g.upload(b));
        g.launch(
            "diff_rows",
            t.rows as u32,
            256,
            0,
            &[
                Arg::Ptr(t.ptr),
                Arg::I32(t.stride as i32),
                Arg::I32(t.width as i32),
                Arg::Ptr(ptr(g, &r.data, 0)),
                Arg::I32(r.width as i32),
                Arg::I32(r.width as i32),
                Arg::Ptr(idx.as_ref().map_or(0, |i| ptr(g, i, 0))),
                Arg::I32(b_row0 as i32),
                Arg::Ptr(ptr(g, out, self.used * 12)),
            ],
        );
        let at = self.used;
        self.used += t.rows;
        Some(at)
    }

    /// Every queued row's summaries, in queue order; empties the buffer.
    pub fn drain(&mut self) -> Vec<[f32; 12]> {
        let (Some(out), Some(g)) = (&self.out, &self.gpu) else {
            return Vec::new();
        };
        let rows = g
            .download(out, self.used * 12)
            .chunks_exact(12)
            .map(|c| c.try_into().expect("12 values"))
            .collect();
        self.used = 0;
        rows
    }

    pub fn is_empty(&self) -> bool {
        self.used == 0
    }
}

/// One token's row metrics from its sub-rows' (heads') summaries, each `w` wide: the same
/// `RowDiff` the host computes over the concatenated row. Also returns the count of bitwise
/// differences.
pub fn combine_rows(rows: &[[f32; 12]], w: usize) -> (RowDiff, f32) {
    let (mut d2, mut b2, mut ab, mut a2, mut bits) = (0f64, 0f64, 0f64, 0f64, 0f32);
    let (mut max_abs, mut max_ref, mut index) = (0f32, 0f32, 0usize);
    let (mut reference, mut value) = (0f32, 0f32);
    let mut non_finite = None;
    for (h, r) in rows.iter().enumerate() {
        if r[0] > max_abs {
            max_abs = r[0];
            index = h * w + r[1] as usize;
            if non_finite.is_none() {
                (value, reference) = (r[9], r[10]);
            }
        }
        if non_finite.is_none() && r[7] >= 0.0 {
            non_finite = Some(h * w + r[7] as usize);
            (value, reference) = (r[9], r[10]);
        }
        max_ref = max_ref.max(r[2]);
        d2 += r[3] as f64;
        b2 += r[4] as f64;
        ab += r[5] as f64;
        a2 += r[6] as f64;
        bits += r[8];
    }
    if max_abs == 0.0 && non_finite.is_none() {
        (value, reference) = (rows[0][9], rows[0][10]);
    }
    let rel_l2 = if b2 > 0.0 {
        (d2 / b2).sqrt()
    } else {
        d2.sqrt()
    };
    let cosine = if a2 > 0.0 && b2 > 0.0 {
        ab / (a2.sqrt() * b2.sqrt())
    } else if a2 == b2 {
        1.0
    } else {
        0.0
    };
    (
        RowDiff {
            index,
            reference,
            value,
            max_abs,
            max_ref,
            rel_l2,
            cosine,
            non_finite,
        },
        bits,
    )
}
