//! The `.npy` reader against hostile and arbitrary files: a 200-byte header
//! whose shape wraps to 0 elements is rejected at once by every command
//! that reads one, leaving no output; arbitrary bytes and headers never
//! panic; valid files round-trip (property tests, bounded to a few seconds:
//! raise `PROPTEST_CASES` for a longer run).

use flashattn_cli::npy::{self, header};
use half::f16;
use proptest::prelude::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// 2²¹ · 2²¹ · 2²¹ · 8 = 2⁶⁶ elements, which u64 arithmetic wraps to 0.
const WRAPPING: &str = "(2097152, 2097152, 2097152, 8)";

/// A version 1.0 `.npy` file: header text padded as numpy pads it, then `data`.
fn npy_bytes(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let pad = (64 - (10 + dict.len() + 1) % 64) % 64;
    let text = format!("{dict}{}\n", " ".repeat(pad));
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((text.len() as u16).to_le_bytes());
    out.extend(text.as_bytes());
    out.extend(data);
    out
}

/// The hostile file of the issue: the wrapping shape and zeros up to 200 bytes.
fn hostile(descr: &str, shape: &str) -> Vec<u8> {
    let mut bytes = npy_bytes(descr, shape, &[]);
    bytes.resize(200, 0);
    bytes
}

/// Any plain array as `.npy`, by the command line's own writer.
fn write<T: npyz::AutoSerialize + Copy>(path: &Path, shape: &[u64], data: &[T]) {
    std::fs::write(path, npy::encode_array(shape, data).unwrap()).unwrap();
}

/// Run the command line in `dir` with the words of `line`, timed.
fn run(dir: &Path, line: &str) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_flashattn"))
        .current_dir(dir)
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .args(line.split_whitespace())
        .output()
        .unwrap();
    (out, start.elapsed())
}

/// Failed within a second with one line naming `needles`, and `dir` holds
/// only the inputs (no output, no partial file).
fn assert_rejected(dir: &Path, (out, took): (Output, Duration), inputs: &[&str], needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "no {needle:?} in: {stderr}");
    }
    assert!(took < Duration::from_secs(1), "took {took:?}: {stderr}");
    let mut left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut want: Vec<String> = inputs.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(left, want, "{stderr}");
}

#[test]
fn forward_rejects_the_200_byte_header_at_once_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = hostile("<f4", WRAPPING);
    assert_eq!(bytes.len(), 200);
    for name in ["q.npy", "k.npy", "v.npy"] {
        std::fs::write(dir.path().join(name), &bytes).unwrap();
    }
    for backend in ["cpu", "wgpu", "auto"] {
        let line = format!(
            "forward --q q.npy --k k.npy --v v.npy --out o.npy --lse lse.npy --backend {backend}"
        );
        assert_rejected(
            dir.path(),
            run(dir.path(), &line),
            &["q.npy", "k.npy", "v.npy"],
            &[
                "q file",
                "q.npy",
                "[2097152, 2097152, 2097152, 8]",
                "overflows",
            ],
        );
    }
    // The backward reads the same files first.
    write(&dir.path().join("do.npy"), &[1, 1, 1, 8], &[0.0f32; 8]);
    let line = "backward --q q.npy --k k.npy --v v.npy --do do.npy --dq dq.npy --dk dk.npy \
                --dv dv.npy --backend cpu";
    assert_rejected(
        dir.path(),
        run(dir.path(), line),
        &["q.npy", "k.npy", "v.npy", "do.npy"],
        &["q file", "overflows"],
    );
}

#[test]
fn every_file_a_command_reads_checks_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    write(&p("q.npy"), &[1, 4, 2, 8], &[0.5f32; 64]);
    write(&p("k.npy"), &[1, 4, 2, 8], &[0.25f32; 64]);
    write(&p("v.npy"), &[1, 4, 2, 8], &[1.0f32; 64]);
    write(&p("packed.npy"), &[4, 2, 8], &[1.0f32; 64]);
    std::fs::write(p("huge_mask.npy"), hostile("|b1", WRAPPING)).unwrap();
    std::fs::write(p("huge_cu.npy"), hostile("<i4", "(4611686018427387904,)")).unwrap();
    std::fs::write(p("huge_cache.npy"), hostile("<f4", WRAPPING)).unwrap();
    std::fs::write(
        p("huge_table.npy"),
        hostile("<i4", "(4294967296, 4294967296)"),
    )
    .unwrap();
    std::fs::write(p("lens.npy"), npy_bytes("<i4", "(1,)", &2i32.to_le_bytes())).unwrap();
    // A header promising more data than the file holds.
    std::fs::write(p("short.npy"), npy_bytes("<f4", "(1, 4, 2, 8)", &[0; 8])).unwrap();
    let inputs = [
        "q.npy",
        "k.npy",
        "v.npy",
        "packed.npy",
        "huge_mask.npy",
        "huge_cu.npy",
        "huge_cache.npy",
        "huge_table.npy",
        "lens.npy",
        "short.npy",
    ];
    let qkv = "forward --q q.npy --k k.npy --v v.npy --out o.npy --backend cpu";
    let mask = run(
        dir.path(),
        &format!("{qkv} --block-mask huge_mask.npy --block-size 1,1"),
    );
    let want = ["block mask", "huge_mask.npy", "overflows"];
    assert_rejected(dir.path(), mask, &inputs, &want);
    let packed = "forward --q packed.npy --k packed.npy --v packed.npy --out o.npy";
    let cu = format!("{packed} --cu-seqlens-q huge_cu.npy --cu-seqlens-k huge_cu.npy");
    let cu = run(dir.path(), &cu);
    assert_rejected(dir.path(), cu, &inputs, &["huge_cu.npy", "overflows"]);
    let short = run(
        dir.path(),
        "forward --q short.npy --k k.npy --v v.npy --out o.npy",
    );
    let want = ["short.npy", "256 bytes", "holds 8"];
    assert_rejected(dir.path(), short, &inputs, &want);
    let decode = |cache: &str, extra: &str| {
        let line = format!(
            "decode --q q.npy --k-cache {cache} --v-cache {cache} --cache-seqlens lens.npy \
             --out o.npy --backend cpu {extra}"
        );
        run(dir.path(), &line)
    };
    let cache = decode("huge_cache.npy", "");
    assert_rejected(
        dir.path(),
        cache,
        &inputs,
        &["k_cache", "huge_cache.npy", "overflows"],
    );
    let table = decode("k.npy", "--block-table huge_table.npy");
    assert_rejected(
        dir.path(),
        table,
        &inputs,
        &["block_table", "huge_table.npy", "overflows"],
    );
}

#[test]
fn npy_errors_are_typed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.npy");
    let read = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        npy::read("x", &path).unwrap_err()
    };
    use flashattn_cli::error::CliError;
    assert!(matches!(
        read(&hostile("<f4", WRAPPING)),
        CliError::NpyTooLarge {
            what: "x",
            max: flashattn::MAX_ELEMENTS,
            ..
        }
    ));
    assert!(matches!(
        read(&npy_bytes("<f4", "(3,)", &[0; 8])),
        CliError::NpyDataLength {
            expected: 12,
            actual: 8,
            ..
        }
    ));
    // Trailing bytes past the shape's data are as wrong as missing ones.
    assert!(matches!(
        read(&npy_bytes("<f4", "(1,)", &[0; 8])),
        CliError::NpyDataLength {
            expected: 4,
            actual: 8,
            ..
        }
    ));
    let mut long_header = b"\x93NUMPY\x02\x00".to_vec();
    long_header.extend(u32::MAX.to_le_bytes());
    assert!(matches!(
        read(&long_header),
        CliError::NotNpy {
            source: header::HeaderError::Truncated { .. },
            ..
        }
    ));
    assert!(matches!(
        read(&npy_bytes(">f4", "(1,)", &[0; 4])),
        CliError::Dtype { .. }
    ));
}

// ---- property tests ----

/// Dims that exercise the checks: 0, small, powers of two up to 2⁶³, and
/// u64's maximum.
fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..6,
        2 => (0u32..64).prop_map(|e| 1u64 << e),
        1 => any::<u64>(),
        1 => Just(u64::MAX),
    ]
}

/// A header dict numpy or another writer might produce, or a near miss.
fn header_text() -> impl Strategy<Value = String> {
    let descr = prop_oneof![
        Just("<f4"),
        Just("<f2"),
        Just("<i4"),
        Just("<i8"),
        Just("|b1"),
        Just("|u1"),
        Just(">f4"),
        Just("<c8"),
        Just("O"),
    ];
    (
        descr,
        any::<bool>(),
        proptest::collection::vec(dim(), 0..6),
        any::<bool>(),
    )
        .prop_map(|(descr, fortran, dims, trailing)| {
            let mut shape: String = dims.iter().map(|d| format!("{d}, ")).collect();
            if !trailing && dims.len() > 1 {
                shape.truncate(shape.len() - 2);
            }
            let order = if fortran { "True" } else { "False" };
            format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': ({shape}), }}")
        })
}

/// The file of a header text and `data`.
fn with_header(text: &str, data: &[u8]) -> Vec<u8> {
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((text.len() as u16).to_le_bytes());
    out.extend(text.as_bytes());
    out.extend(data);
    out
}

/// Every reader on `bytes`: none may panic; a tensor read must hold
/// exactly the elements of its shape.
fn read_all_ways(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    if let Ok(t) = npy::read("x", path) {
        assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
    }
    if let Ok(a) = npy::read_index("x", path, 2, "2 dims") {
        assert_eq!(a.data.len(), a.shape.iter().product::<usize>());
    }
    if let Ok((shape, data)) = npy::read_mask("x", path, 4, "4 dims") {
        assert_eq!(data.len(), shape.iter().product::<usize>());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..300), magic in any::<bool>()) {
        if magic && bytes.len() >= 8 {
            bytes[..8].copy_from_slice(b"\x93NUMPY\x01\x00");
        }
        let dir = tempfile::tempdir().unwrap();
        read_all_ways(&dir.path().join("x.npy"), &bytes);
    }

    #[test]
    fn arbitrary_header_text_never_panics(text in proptest::collection::vec(any::<char>(), 0..200)) {
        let text: String = text.into_iter().collect();
        let _ = header::parse_dict(&text);
        let dir = tempfile::tempdir().unwrap();
        read_all_ways(&dir.path().join("x.npy"), &with_header(&text, &[]));
    }

    #[test]
    fn arbitrary_headers_with_data_never_panic(text in header_text(), data in proptest::collection::vec(any::<u8>(), 0..96)) {
        let dir = tempfile::tempdir().unwrap();
        read_all_ways(&dir.path().join("x.npy"), &with_header(&text, &data));
    }

    #[test]
    fn valid_files_round_trip(
        shape in proptest::collection::vec(0usize..5, 1..5),
        seed in any::<u64>(),
    ) {
        let n: usize = shape.iter().product();
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let mut rng = flashattn::random::Rng::new(seed);
        let values = rng.normal_vec(n, 1.0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        write(&path, &dims, &values);
        let t = npy::read("x", &path).unwrap();
        prop_assert_eq!(&t.shape, &shape);
        prop_assert_eq!(t.to_f32(), values.clone());
        let halves: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
        write(&path, &dims, &halves);
        let t = npy::read("x", &path).unwrap();
        prop_assert_eq!(t.data, flashattn::TensorData::F16(halves));
        let ints: Vec<i64> = values.iter().map(|&x| (x * 1000.0) as i64).collect();
        write(&path, &dims, &ints);
        let a = npy::read_index("x", &path, shape.len(), "any").unwrap();
        prop_assert_eq!(a.shape, shape);
        prop_assert_eq!(a.data, ints.iter().map(|&x| x as i32).collect::<Vec<_>>());
    }
}

/// A FIFO at `dir/name` fed `bytes` by a thread (`None` where this host
/// has no mkfifo).
#[cfg(unix)]
fn fifo(dir: &Path, name: &str, bytes: Vec<u8>) -> Option<std::path::PathBuf> {
    let path = dir.join(name);
    let made = Command::new("mkfifo").arg(&path).status();
    if !made.is_ok_and(|s| s.success()) {
        return None;
    }
    let writer = path.clone();
    std::thread::spawn(move || {
        use std::io::Write;
        // The reader may stop early (a rejected header): a broken pipe is fine.
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(writer)
            .and_then(|mut f| f.write_all(&bytes));
    });
    Some(path)
}

/// A pipe, a FIFO or a device has no length to check a header against: it
/// is read (its header first, then at most the data its shape needs), so
/// `--q <(...)` works, and a stream whose shape claims more than it
/// delivers is the same length error as a file, without allocating the
/// claim.
#[cfg(unix)]
#[test]
fn npy_streams_are_read_and_checked_like_files() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let bytes = npy::encode_array(&[2, 3, 4], &data).unwrap();
    let Some(good) = fifo(dir.path(), "good", bytes.clone()) else {
        return;
    };
    let (shape, read) = npy::read_f32("q", &good).unwrap();
    assert_eq!((shape, read), (vec![2, 3, 4], data));
    // Cut short: the length error of a file.
    let short = fifo(dir.path(), "short", bytes[..bytes.len() - 3].to_vec()).unwrap();
    assert!(matches!(
        npy::read_f32("q", &short),
        Err(flashattn_cli::CliError::NpyDataLength { .. })
    ));
    // A header claiming 51 GB followed by 1 MiB: rejected once the stream
    // ends, having held what it delivered.
    let mut claim = npy_bytes("<f4", "(1000, 1000, 100, 128)", &[]);
    claim.resize(claim.len() + (1 << 20), 0);
    let claim = fifo(dir.path(), "claim", claim).unwrap();
    assert!(matches!(
        npy::read_f32("q", &claim),
        Err(flashattn_cli::CliError::NpyDataLength { .. })
    ));
    // Not an .npy at all: the header error, not the whole stream read.
    let text = fifo(dir.path(), "text", b"hello world\n".to_vec()).unwrap();
    assert!(matches!(
        npy::read_f32("q", &text),
        Err(flashattn_cli::CliError::NotNpy { .. })
    ));
}
