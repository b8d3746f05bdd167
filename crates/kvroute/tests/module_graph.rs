//! The layout keeps module dependencies one-way: in every crate of the workspace, the graph of
//! "module A names an item of module B" (through `crate::` or `super::` paths, outside comments
//! and test modules) has no cycle. A cycle is where a layout stops saying which part is built on
//! which; this test names the modules of any cycle it finds, so a change that adds one fails
//! here with the edges to cut.
//!
//! The scan is textual (the workspace has no proc-macro-generated `crate::` paths), which is
//! enough to see every `use crate::...` and every fully qualified path.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file (`data_plane/mod.rs` -> `data_plane`, `lib.rs` -> ``), or
/// `None` for files included by `#[path]` as test modules.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p.ends_with("_tests")) {
        return None;
    }
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    }
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    Some(parts.join("::"))
}

/// The code of a file without comments and without its `#[cfg(test)]` tail.
fn code_of(text: &str) -> String {
    let body = match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => text,
    };
    body.lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Paths following `crate::` or `super::` (each as its segments, `super` resolved against
/// `module`), including the items of a `crate::{a::b, c}` group.
fn referenced_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    for anchor in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(anchor) {
            let start = from + pos;
            from = start + anchor.len();
            if start > 0 && is_ident_byte(bytes[start - 1]) {
                continue;
            }
            let base: Vec<String> = if anchor == "super::" {
                module[..module.len().saturating_sub(1)].to_vec()
            } else {
                Vec::new()
            };
            let rest = &code[from..];
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let mut path = base.clone();
                    path.extend(segments(item.trim()));
                    out.push(path);
                }
            } else {
                let mut path = base;
                path.extend(segments(rest));
                out.push(path);
            }
        }
    }
    out
}

fn segments(text: &str) -> Vec<String> {
    let mut segs = Vec::new();
    let mut rest = text;
    loop {
        let len = rest.bytes().take_while(|&b| is_ident_byte(b)).count();
        if len == 0 {
            break;
        }
        segs.push(rest[..len].to_string());
        match rest[len..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    segs
}

/// Module -> modules it depends on, for the crate whose sources are in `src`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<String, PathBuf> = files
        .iter()
        .filter_map(|f| module_of(src, f).map(|m| (m, f.clone())))
        .collect();
    let mut graph = BTreeMap::new();
    for (module, file) in &modules {
        let code = code_of(&std::fs::read_to_string(file).expect("readable source"));
        let segs: Vec<String> = if module.is_empty() {
            Vec::new()
        } else {
            module.split("::").map(str::to_string).collect()
        };
        let mut deps = BTreeSet::new();
        for path in referenced_paths(&code, &segs) {
            // The longest prefix of the path that is a module is the module depended on; a path
            // naming a root item (`crate::Router`) depends on the root.
            let target = (1..=path.len())
                .rev()
                .map(|k| path[..k].join("::"))
                .find(|cand| modules.contains_key(cand))
                .or_else(|| {
                    path.first()
                        .filter(|p| p.starts_with(|c: char| c.is_ascii_uppercase()))
                        .map(|_| String::new())
                });
            if let Some(t) = target
                && &t != module
            {
                deps.insert(t);
            }
        }
        graph.insert(module.clone(), deps);
    }
    graph
}

/// The strongly connected components with more than one module (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn no_crate_of_the_workspace_has_a_module_cycle() {
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    let mut report = Vec::new();
    for entry in std::fs::read_dir(&crates).expect("crates dir") {
        let src = entry.expect("crate dir").path().join("src");
        if !src.is_dir() {
            continue;
        }
        let graph = module_graph(&src);
        checked += 1;
        for component in cycles(&graph) {
            let edges: Vec<String> = component
                .iter()
                .map(|m| {
                    let inside: Vec<&str> = graph[m]
                        .iter()
                        .filter(|d| component.contains(d))
                        .map(String::as_str)
                        .collect();
                    format!("{m:?} -> {inside:?}")
                })
                .collect();
            report.push(format!("{}: {}", src.display(), edges.join("; ")));
        }
    }
    assert!(
        checked >= 8,
        "expected the workspace's crates, found {checked}"
    );
    assert!(report.is_empty(), "module cycles:\n{}", report.join("\n"));
}

#[test]
fn the_cycle_finder_sees_a_planted_cycle_and_a_root_reexport() {
    let dir = std::env::temp_dir().join(format!("kvroute-modgraph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("room")).unwrap();
    std::fs::write(
        dir.join("lib.rs"),
        "pub mod a;\npub mod room;\npub use room::Thing;\nfn f() { a::g(); }\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("a.rs"),
        "use crate::room::inner::Thing;\n// crate::lib_only in a comment is ignored\n",
    )
    .unwrap();
    std::fs::write(dir.join("room/mod.rs"), "pub mod inner;\n").unwrap();
    std::fs::write(dir.join("room/inner.rs"), "use crate::{a, Thing};\n").unwrap();
    let graph = module_graph(&dir);
    assert_eq!(graph["a"], BTreeSet::from(["room::inner".to_string()]));
    assert_eq!(
        graph["room::inner"],
        BTreeSet::from(["a".to_string(), String::new()])
    );
    assert_eq!(
        cycles(&graph),
        vec![vec!["a".to_string(), "room::inner".to_string()]]
    );
    std::fs::write(dir.join("room/inner.rs"), "pub struct Thing;\n").unwrap();
    assert!(cycles(&module_graph(&dir)).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}
