use super::Batching;

/// Sentence lengths by index, and the batches `batching` cuts `order` into, as lengths.
fn cut(batching: Batching, lens: &[usize]) -> Vec<Vec<usize>> {
    let order: Vec<usize> = (0..lens.len()).collect();
    batching
        .split(&order, &|i| lens[i])
        .iter()
        .map(|b| b.iter().map(|&i| lens[i]).collect())
        .collect()
}

#[test]
fn batches_hold_at_most_the_sentences_asked() {
    let lens = [1, 2, 2, 3, 5, 8, 8];
    assert_eq!(
        cut(Batching::sentences(3), &lens),
        [vec![1, 2, 2], vec![3, 5, 8], vec![8]]
    );
    assert_eq!(cut(Batching::sentences(100), &lens), [lens.to_vec()]);
    assert!(cut(Batching::sentences(3), &[]).is_empty());
}

/// Padded tokens (sentences × the longest) stay within `max_tokens`; a sentence longer
/// than that is a batch alone; the sentence cap still holds; an empty sentence counts 1.
#[test]
fn batches_hold_at_most_the_tokens_asked() {
    let tokens = |sentences, max_tokens| Batching {
        sentences,
        max_tokens: Some(max_tokens),
    };
    let lens = [1, 2, 2, 3, 5, 8, 8, 20];
    assert_eq!(
        cut(tokens(100, 8), &lens),
        [vec![1, 2, 2], vec![3], vec![5], vec![8], vec![8], vec![20]]
    );
    assert_eq!(
        cut(tokens(100, 16), &lens),
        [vec![1, 2, 2, 3], vec![5, 8], vec![8], vec![20]]
    );
    assert_eq!(
        cut(tokens(2, 1000), &lens),
        [vec![1, 2], vec![2, 3], vec![5, 8], vec![8, 20]]
    );
    assert_eq!(cut(tokens(100, 3), &[0, 0, 0, 0]), [vec![0, 0, 0], vec![0]]);
    for (batch, max) in [(1, 1), (3, 7), (8, 40)] {
        for b in cut(tokens(batch, max), &lens) {
            let padded = b.len() * b.iter().max().unwrap().max(&1);
            assert!(b.len() <= batch, "{b:?}");
            assert!(padded <= max || b.len() == 1, "{b:?} over {max} tokens");
        }
    }
}
