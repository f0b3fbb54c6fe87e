//! The library's shape, checked on its source: its modules import each
//! other without circles (so each layer can be read and changed on its
//! own) and only from their own layer or those below it (src/lib.rs's
//! "Layers"), no function is longer than 80 lines, nothing silences
//! clippy's `too_many_arguments`, and no parameter list dodges it by
//! packing distinct arguments into a tuple or array.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The module path of a file: `src/a/b.rs` and `src/a/b/mod.rs` are `a::b`,
/// `src/lib.rs` is the crate root (empty).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The source without comments, string and char literals (their insides
/// become spaces; line breaks are kept, so line numbers stay right).
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    while i < c.len() {
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            while i < c.len() && !(c[i] == '*' && c.get(i + 1) == Some(&'/')) {
                out.push(blank(c[i]));
                i += 1;
            }
            i += 2;
        } else if c[i] == 'r'
            && (c.get(i + 1) == Some(&'"') || c.get(i + 1) == Some(&'#'))
            && !c[i.saturating_sub(1)].is_alphanumeric()
        {
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            i += 2 + hashes;
            while i < c.len() && !c[i..].iter().collect::<String>().starts_with(&close) {
                out.push(blank(c[i]));
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                out.push(blank(c[i]));
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && (c.get(i + 2) == Some(&'\'') || c.get(i + 1) == Some(&'\\')) {
            // A char literal ('x' or '\n'), not a lifetime.
            let end = (i + 1..c.len())
                .find(|&j| c[j] == '\'' && (j > i + 2 || c[i + 1] != '\\'))
                .unwrap_or(i + 2);
            i = end + 1;
            out.push_str("' '");
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Module paths a file names: `crate::a::b`, `super::c`, and the items of
/// `use` brace groups (`crate::a::{b, c::d}`), as absolute segment lists.
fn referenced_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    for (start, anchor) in find_all(&bytes, &["crate::", "super::"]) {
        if start > 0 && (bytes[start - 1].is_alphanumeric() || bytes[start - 1] == '_') {
            continue;
        }
        let base: Vec<String> = if anchor == "crate::" {
            Vec::new()
        } else {
            // `super` of `a::b` is `a`, whether in `a/b.rs` or `a/b/mod.rs`.
            module[..module.len().saturating_sub(1)].to_vec()
        };
        let tail = parse_path(&bytes[start + anchor.len()..]);
        for t in tail {
            let mut p = base.clone();
            p.extend(t);
            out.push(p);
        }
    }
    out
}

fn find_all(c: &[char], needles: &[&'static str]) -> Vec<(usize, &'static str)> {
    let mut out = Vec::new();
    for i in 0..c.len() {
        for n in needles {
            if c[i..].iter().take(n.len()).copied().eq(n.chars()) {
                out.push((i, *n));
            }
        }
    }
    out
}

/// `a::b::{c, d::e}` → [[a, b, c], [a, b, d, e]]; `a::b` → [[a, b]].
fn parse_path(c: &[char]) -> Vec<Vec<String>> {
    let mut segs = Vec::new();
    let mut i = 0;
    loop {
        let ident: String = c[i..]
            .iter()
            .take_while(|ch| ch.is_alphanumeric() || **ch == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        i += ident.len();
        segs.push(ident);
        if c[i..].starts_with(&[':', ':']) {
            i += 2;
            if c.get(i) == Some(&'{') {
                let close = matching(c, i);
                let inner: String = c[i + 1..close].iter().collect();
                return inner
                    .split(',')
                    .flat_map(|item| {
                        let item: Vec<char> = item.trim().chars().collect();
                        parse_path(&item).into_iter().map(|mut t| {
                            let mut p = segs.clone();
                            p.append(&mut t);
                            p
                        })
                    })
                    .chain(std::iter::once(segs.clone()))
                    .collect();
            }
        } else {
            break;
        }
    }
    vec![segs]
}

fn matching(c: &[char], open: usize) -> usize {
    let mut depth = 0;
    for (j, ch) in c.iter().enumerate().skip(open) {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    c.len()
}

/// The library's import graph: module → modules it names.
fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = rust_files(&src);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let mut edges = BTreeSet::new();
        for path in referenced_paths(&code, &module) {
            // The deepest module the path names.
            let target = (0..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| modules.contains(p))
                .unwrap_or_default();
            if target != module {
                edges.insert(target.join("::"));
            }
        }
        graph.insert(module.join("::"), edges);
    }
    graph
}

/// A cycle in `graph`, if any, as the modules along it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(1) => {
                    let from = stack.iter().position(|s| s == next).unwrap_or(0);
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(next, graph, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if !state.contains_key(node) {
            if let Some(c) = visit(node, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_checker_sees_imports_and_cycles() {
    let code =
        code_only("use crate::a::{b, c::d};\n// crate::x\nlet s = \"crate::y\";\nsuper::e::f();\n");
    let paths = referenced_paths(&code, &["m".into(), "n".into()]);
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(joined, ["a::b", "a::c::d", "a", "m::e::f"]);
    let g: BTreeMap<String, BTreeSet<String>> =
        [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
            .collect();
    assert_eq!(find_cycle(&g).unwrap(), ["a", "b", "c", "a"]);
}

#[test]
fn library_modules_import_without_circles() {
    let graph = import_graph();
    assert!(graph.len() > 30, "{} modules", graph.len());
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import circle: {}", cycle.join(" -> "));
    }
}

/// The library's layers from the bottom up (src/lib.rs's "Layers"): what
/// callers hand in and get back, the planner, the kernels, the runtime,
/// the operations, and the backends on top; the f64 reference, the
/// accuracy rule and the one call model every backend implements
/// (`backend::attend`) sit low, the CPU backend beside the kernels.
const LAYERS: &[&[&str]] = &[
    &["error", "random", "disk_cache", "philox"],
    &["api"],
    &["plan", "quant", "kv_quant"],
    &["reference", "accuracy", "backend::attend"],
    &["kernels", "cpu"],
    &["runtime"],
    &["ops"],
    &["verify"],
    &["tune"],
    &["engine"],
    &["choice"],
    &["cuda"],
    &["backend"],
];

/// The layer of `module`: that of the longest entry of [`LAYERS`] it is or
/// lies under; `None` for the crate root and modules no layer lists.
fn layer_of(module: &str) -> Option<usize> {
    let under = |entry: &str| module == entry || module.starts_with(&format!("{entry}::"));
    LAYERS
        .iter()
        .enumerate()
        .flat_map(|(rank, names)| names.iter().map(move |n| (rank, *n)))
        .filter(|(_, name)| under(name))
        .max_by_key(|(_, name)| name.len())
        .map(|(rank, _)| rank)
}

#[test]
fn layers_import_only_their_own_and_those_below() {
    let graph = import_graph();
    let mut upward = Vec::new();
    for (module, targets) in &graph {
        if module.is_empty() {
            continue;
        }
        let Some(from) = layer_of(module) else {
            panic!("{module} is in no layer: add it to LAYERS");
        };
        for target in targets.iter().filter(|t| !t.is_empty()) {
            let to = layer_of(target).unwrap_or_else(|| panic!("{target} is in no layer"));
            if to > from {
                upward.push(format!(
                    "{module} (layer {from}) imports {target} (layer {to})"
                ));
            }
        }
    }
    // Among them: `api`, what every backend shares, imports nothing of the planner.
    assert!(
        upward.is_empty(),
        "imports up the layers:\n{}",
        upward.join("\n")
    );
}

#[test]
fn a_module_takes_the_layer_of_its_longest_listed_prefix() {
    assert_eq!(layer_of("backend::attend"), Some(3));
    assert_eq!(layer_of("backend"), Some(12));
    assert_eq!(layer_of("plan::tiles"), Some(2));
    assert_eq!(layer_of("apis"), None);
    assert!(layer_of("api::output") < layer_of("plan::tiles"));
}

/// `(file:line, name, lines)` of every `fn` item in `code`.
fn functions(file: &str, code: &str) -> Vec<(String, String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let after_fn = [
            "fn ",
            "pub fn ",
            "pub(crate) fn ",
            "async fn ",
            "pub async fn ",
            "pub(crate) async fn ",
            "const fn ",
            "pub const fn ",
        ]
        .iter()
        .find_map(|p| t.strip_prefix(p));
        let Some(rest) = after_fn else { continue };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // Find the body's braces from here (a declaration without body ends in `;`).
        let mut depth = 0i32;
        let mut opened = false;
        for (m, l) in lines.iter().enumerate().skip(n) {
            for ch in l.chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened && depth == 0 => break,
                    _ => {}
                }
            }
            if !opened && l.trim_end().ends_with(';') {
                break;
            }
            if opened && depth == 0 {
                out.push((format!("{file}:{}", n + 1), name.clone(), m - n + 1));
                break;
            }
        }
    }
    out
}

#[test]
fn no_library_function_is_longer_than_80_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut long = Vec::new();
    let mut count = 0;
    for file in rust_files(&src) {
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        let name = file.strip_prefix(&src).unwrap().display().to_string();
        for (at, f, n) in functions(&name, &code) {
            count += 1;
            if n > 80 {
                long.push(format!("{at} {f}: {n} lines"));
            }
        }
    }
    assert!(count > 200, "found only {count} functions");
    assert!(
        long.is_empty(),
        "functions over 80 lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_library_code_silences_too_many_arguments() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for file in rust_files(&src) {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            !text.contains("too_many_arguments"),
            "{} allows too_many_arguments",
            file.display()
        );
    }
}

/// Split `s` at the commas outside brackets (`()`, `[]`, `{}`, `<>`; the
/// `>` of `->` closes nothing).
fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    let mut prev = ' ';
    for ch in s.chars() {
        match ch {
            '(' | '[' | '{' | '<' => depth += 1,
            '>' if prev == '-' => {}
            ')' | ']' | '}' | '>' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                prev = ch;
                continue;
            }
            _ => {}
        }
        cur.push(ch);
        prev = ch;
    }
    out.push(cur);
    out.into_iter()
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .collect()
}

/// The index just past the bracket that closes the one at `open`.
fn closing(c: &[char], open: usize) -> usize {
    let mut depth = 0i32;
    for (j, ch) in c.iter().enumerate().skip(open) {
        match ch {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
    }
    c.len()
}

/// `(line, fn name, parameter list)` of every `fn` in `code`.
fn parameter_lists(code: &str) -> Vec<(usize, String, String)> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    for (at, _) in find_all(&c, &["fn "]) {
        if at > 0 && (c[at - 1].is_alphanumeric() || c[at - 1] == '_') {
            continue;
        }
        let mut i = at + 3;
        let name: String = c[i..]
            .iter()
            .take_while(|ch| ch.is_alphanumeric() || **ch == '_')
            .collect();
        i += name.len();
        // Generics, whose bounds may hold `Fn(..) -> T`.
        let mut depth = 0i32;
        while i < c.len() && (depth > 0 || c[i] != '(') {
            match c[i] {
                '<' => depth += 1,
                '>' if c[i - 1] != '-' => depth -= 1,
                _ => {}
            }
            i += 1;
        }
        if name.is_empty() || i >= c.len() {
            continue;
        }
        let end = closing(&c, i);
        let line = c[..at].iter().filter(|&&ch| ch == '\n').count() + 1;
        out.push((line, name, c[i + 1..end - 1].iter().collect()));
    }
    out
}

/// Whether the destructured parameter `param` packs distinct arguments: a
/// tuple pattern whose element types differ (integer types count as one),
/// or an array pattern of references, buffers, bindings, tensor views or
/// device slices. One value's coordinates or dims stay as they are.
fn is_pack(param: &str) -> bool {
    let Some((pattern, ty)) = param.split_once(": ") else {
        return false;
    };
    let (pattern, ty) = (pattern.trim_start_matches('&'), ty.trim_start_matches('&'));
    let ints = [
        "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize",
    ];
    if pattern.starts_with('(') && ty.starts_with('(') {
        let kinds: BTreeSet<String> = split_top(&ty[1..ty.len() - 1])
            .into_iter()
            .map(|t| {
                if ints.contains(&t.as_str()) {
                    "int".into()
                } else {
                    t
                }
            })
            .collect();
        return kinds.len() > 1;
    }
    if pattern.starts_with('[') && ty.starts_with('[') {
        let element = ty[1..].rsplit_once(';').map_or(ty, |(e, _)| e);
        let device = ["Buffer", "TensorView", "CudaSlice"];
        return element.contains('&') || device.iter().any(|d| element.contains(d));
    }
    false
}

/// `line fn: parameter` of every parameter in `code` that [`is_pack`].
fn packed_parameters(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (line, name, params) in parameter_lists(code) {
        for p in split_top(&params).into_iter().filter(|p| is_pack(p)) {
            out.push(format!("{line} {name}: {p}"));
        }
    }
    out
}

#[test]
fn the_checker_sees_packed_parameters() {
    let code = code_only(
        "fn a((x, y): (&Foo, Bar), [q, k]: [&TensorView<'_>; 2]) {}\n\
         // fn c((x, y): (A, B)) {}\n\
         pub(crate) async fn b<F: Fn(u8) -> u8>(\n    &self,\n    (n, s, l): (usize, u64, u64),\n    \
         [d, dv]: [u32; 2],\n    [a, b]: &[wgpu::BufferBinding<'a>; 2],\n    f: F,\n) -> u8 {}\n",
    );
    assert_eq!(
        packed_parameters(&code),
        [
            "1 a: (x, y): (&Foo, Bar)",
            "1 a: [q, k]: [&TensorView<'_>; 2]",
            "3 b: [a, b]: &[wgpu::BufferBinding<'a>; 2]",
        ]
    );
}

#[test]
fn no_library_parameter_list_is_packed_into_tuples_or_arrays() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut packed = Vec::new();
    for file in rust_files(&src) {
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        let name = file.strip_prefix(&src).unwrap().display().to_string();
        packed.extend(
            packed_parameters(&code)
                .into_iter()
                .map(|p| format!("{name}:{p}")),
        );
    }
    assert!(
        packed.is_empty(),
        "parameters packed into a tuple or array (pass them one by one, or as a named struct):\n{}",
        packed.join("\n")
    );
}
